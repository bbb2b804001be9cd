"""The device page pool: preallocated K/V pages for every layer, a free list, and page moves.

All layers live in one tensor `[num_layers, 2 (K, V), num_pages + 1, page_size, heads, head_dim]`:
`k_cache(l)` is a contiguous view (what paged kernels want), and a user's pages over all
layers move to or from the host tier in one `index_select` / `index_copy_`. The pool knows
nothing about users: the manager owns the page lists, the pool only hands pages out and back.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .config import PageLayout
from .paged_kvcache_ops import as_words

Pages = array | Sequence[int]  # page ids; the pool hands out array("q")


class DevicePagePool:
    """Pages of `layout` on `device`, handed out and taken back by page id (no user bookkeeping)."""

    def __init__(self, layout: PageLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        # Zeroed so that a kernel reading a whole page (masked) never meets NaN garbage. One page more
        # than the pool hands out: the sink, where padding rows of a bucketed batch append their K/V.
        self.kv = torch.zeros(
            (layout.num_layers, 2, num_pages + 1, layout.page_size, layout.num_heads, layout.head_dim),
            dtype=layout.dtype,
            device=device,
        )
        # Page ids are kept in int64 arrays (here and in the manager's page lists): compact, and no
        # per-page Python objects to chase through memory when there are many users.
        self._free = array("q", range(num_pages - 1, -1, -1))  # a stack: low pages are handed out first
        self._is_free = np.ones(num_pages, dtype=bool)
        self._cuda = device.type == "cuda"
        # Onloads and offloads each have a stream of their own: compute never queues behind a copy,
        # and a copy waits on the device (events) only for the work it depends on.
        self._onload_stream = torch.cuda.Stream(device) if self._cuda else None
        self._offload_stream = torch.cuda.Stream(device) if self._cuda else None
        self._written: torch.cuda.Event | None = None
        self._onloaded: torch.cuda.Event | None = None  # the last onload: host memory it reads is busy
        self._compute_waits_for: torch.cuda.Event | None = None  # an onload compute has not waited for yet

    # --- views ---
    @property
    def sink_slot(self) -> int:
        """A slot of the sink page: never handed out, never read (a write-only target for padding)."""
        return self.num_pages * self.layout.page_size

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

    def alloc(self, n: int) -> Pages:
        if n > len(self._free):
            raise RuntimeError(f"Page pool exhausted: asked for {n} pages, {len(self._free)} free.")
        if n == 0:
            return array("q")
        pages = self._free[:-n - 1:-1]  # from the top of the stack, lowest page first
        del self._free[-n:]
        self._is_free[pages] = False
        return pages

    def free(self, pages: Pages) -> None:
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        if self._is_free[idx].any() or len(np.unique(idx)) != len(idx):
            raise RuntimeError(f"Double free among pages {sorted(pages)}.")
        self._is_free[idx] = True
        self._free.extend(pages)

    def free_pages(self) -> list[int]:
        return list(self._free)

    # --- page moves (one batched copy per call, all layers) ---
    def mark_written(self) -> None:
        """Record that the pool writes issued so far on the current stream are ones later copies must see.

        The manager calls it at commit (after the appends); `copy_out`, on the offload stream, waits
        for the latest mark and for the last onload. No-op on CPU.
        """
        if self._cuda:
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(self.device))

    def copy_out(self, pages: Pages, dst: Tensor) -> None:
        """Copy `pages` into `dst` ([len(pages), *page_shape], any device); returns when dst holds them.

        On CUDA the gather and the device-to-host copy run on a side stream (into pinned memory
        when dst is), after the last `mark_written`, and this call waits for them: freeing the
        pages afterwards is safe.
        """
        src = self._pool_rows()
        if not self._cuda:
            idx = self._index(pages)
            if dst.device == self.device:
                _index_select_into(src, idx, self._as_rows(dst).transpose(0, 1))
            else:  # another accelerator: gather there, then a blocking copy
                dst.copy_(self._gather(src, idx).view(dst.shape))
            return
        stream = self._offload_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for event in (self._written, self._onloaded):
                if event is not None:
                    stream.wait_event(event)
            staged = self._gather(src, self._index(pages))
            dst.copy_(staged.view(dst.shape), non_blocking=True)
        stream.synchronize()

    def copy_in(self, pages: Pages, src: Tensor) -> None:
        """Write `src` ([len(pages), *page_shape], any device) into `pages`.

        On CUDA the copy runs on the onload stream, after the work already queued on the current
        stream (the pages may have been freed by a batch still computing there), and returns at
        once: from pinned host memory it is an asynchronous DMA. Compute waits for it on the
        device at its first read of the pool (`wait_for_onloads`); the host memory it reads must
        stay unchanged until `sync_onloads` (the manager calls it before any tier write).
        """
        if not self._cuda:
            self._scatter(self._index(pages), src.to(self.device))
            return
        stream = self._onload_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self._scatter(self._index(pages), src.to(self.device, non_blocking=True))
            self._onloaded = torch.cuda.Event()
            self._onloaded.record(stream)
        self._compute_waits_for = self._onloaded

    def wait_for_onloads(self) -> None:
        """Make the current stream wait (on the device, the host does not block) for the onloads issued
        so far. Not while capturing a CUDA graph: the caller waited before the capture or replay."""
        event = self._compute_waits_for
        if event is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(event)
            self._compute_waits_for = None

    def sync_onloads(self) -> None:
        """Block until the onloads issued so far have read their host memory (before it is rewritten)."""
        if self._onloaded is not None:
            self._onloaded.synchronize()
            self._onloaded = None

    def _scatter(self, idx: Tensor, src: Tensor) -> None:
        """pool pages `idx` <- `src` [k, *page_shape] on the pool's device, all layers in one pass."""
        src = self._as_rows(src).transpose(0, 1)
        dst = self._pool_rows()
        words = as_words(dst, src) if self.device.type == "cpu" else None
        (words[0] if words else dst).index_copy_(1, idx, words[1] if words else src)

    @property
    def _page_numel(self) -> int:
        lay = self.layout
        return lay.page_size * lay.num_heads * lay.head_dim

    def _index(self, pages: Pages) -> Tensor:
        return torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(self.device)

    def _pool_rows(self) -> Tensor:
        """The pool as [L*2, num_pages + 1, S*H*D]."""
        return self.kv.view(-1, self.num_pages + 1, self._page_numel)

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
