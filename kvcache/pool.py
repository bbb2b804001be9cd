"""The device page pool: preallocated K/V pages for every layer, a free list, and page moves.

All layers live in one tensor `[num_layers, 2 (K, V), num_pages, page_size, heads, head_dim]`:
`k_cache(l)` is a contiguous view (what paged kernels want), and a user's pages over all
layers move to or from the host tier in one `index_select` / `index_copy_`. The pool knows
nothing about users: the manager owns the page lists, the pool only hands pages out and back.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .config import PageLayout
from .paged_kvcache_ops import as_words


class DevicePagePool:
    def __init__(self, layout: PageLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        # Zeroed so that a kernel reading a whole page (masked) never meets NaN garbage.
        self.kv = torch.zeros(
            (layout.num_layers, 2, num_pages, layout.page_size, layout.num_heads, layout.head_dim),
            dtype=layout.dtype,
            device=device,
        )
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._is_free = np.ones(num_pages, dtype=bool)
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._written: torch.cuda.Event | None = None

    # --- views ---
    def k_cache(self, layer: int) -> Tensor:
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> Tensor:
        return self.kv[layer, 1]

    # --- free list ---
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"Page pool exhausted: asked for {n} pages, {len(self._free)} free.")
        if n == 0:
            return []
        pages = self._free[:-n - 1:-1]  # from the end of the stack, lowest page first
        del self._free[-n:]
        self._is_free[pages] = False
        return pages

    def free(self, pages: Sequence[int]) -> None:
        if not pages:
            return
        if self._is_free[pages].any() or len(set(pages)) != len(pages):
            raise RuntimeError(f"Double free among pages {sorted(pages)}.")
        self._is_free[pages] = True
        self._free.extend(pages)

    def free_pages(self) -> list[int]:
        return list(self._free)

    # --- page moves (one batched copy per call, all layers) ---
    def mark_written(self) -> None:
        """Record that appends issued so far on the current stream are the ones later copies must see.

        The manager calls it at commit; `copy_out` on the side stream waits for it. No-op on CPU.
        """
        if self._cuda:
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(self.device))

    def copy_out(self, pages: Sequence[int], dst: Tensor) -> None:
        """Copy `pages` into `dst` ([len(pages), *page_shape], any device); returns when dst holds them."""
        idx = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        src = self._pool_rows()
        if dst.device == self.device:
            _index_select_into(src, idx, self._as_rows(dst).transpose(0, 1))
            return
        if not self._cuda:  # another accelerator: gather there, then a blocking copy
            dst.copy_(self._gather(src, idx).view(dst.shape))
            return
        stream = self._copy_stream
        with torch.cuda.stream(stream):
            if self._written is not None:
                stream.wait_event(self._written)
            staged = self._gather(src, idx)
            dst.copy_(staged.view(dst.shape), non_blocking=True)
        stream.synchronize()

    def copy_in(self, pages: Sequence[int], src: Tensor) -> None:
        """Write `src` ([len(pages), *page_shape], any device) into `pages`, in stream order on the current stream."""
        idx = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        src = self._as_rows(src.to(self.device, non_blocking=True)).transpose(0, 1)  # async from pinned memory
        dst = self._pool_rows()
        words = as_words(dst, src) if self.device.type == "cpu" else None
        (words[0] if words else dst).index_copy_(1, idx, words[1] if words else src)

    @property
    def _page_numel(self) -> int:
        lay = self.layout
        return lay.page_size * lay.num_heads * lay.head_dim

    def _pool_rows(self) -> Tensor:
        """The pool as [L*2, num_pages, S*H*D]."""
        return self.kv.view(-1, self.num_pages, self._page_numel)

    def _as_rows(self, pages: Tensor) -> Tensor:
        """[k, L, 2, S, H, D] -> [k, L*2, S*H*D] view."""
        return pages.view(pages.shape[0], -1, self._page_numel)

    def _gather(self, src: Tensor, idx: Tensor) -> Tensor:
        out = torch.empty((idx.numel(), src.shape[0], src.shape[2]), dtype=src.dtype, device=src.device)
        _index_select_into(src, idx, out.transpose(0, 1))
        return out


def _index_select_into(src: Tensor, idx: Tensor, out: Tensor) -> None:
    """out = src[:, idx] in one pass (as 16-byte words on CPU)."""
    words = as_words(src, out) if src.device.type == "cpu" else None
    if words is None:
        torch.index_select(src, 1, idx, out=out)
    else:
        torch.index_select(words[0], 1, idx, out=words[1])
