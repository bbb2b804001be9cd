"""The device page pool: preallocated K/V pages for every layer, a free list, and page moves.

All layers live in one tensor `[num_layers, 2 (K, V), num_pages + 1, page_size, heads, head_dim]`:
`k_cache(l)` is a contiguous view (what paged kernels want). Each token's time lives beside it in
`times [num_pages + 1, page_size]` int64 (`times_cache()`), addressed by the same slots, and moves
with its page. On CPU a user's pages over all
layers move to or from the host tier in one `index_select` / `index_copy_`; on CUDA an onload
moves them layer by layer on its own stream, so that compute waits for each layer only
(`OnloadEvents`). The pool knows nothing about users: the manager owns the page lists, the
pool only hands pages out and back.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .onload_events import OnloadEvents
from .page_data import EncodedPageData, HostPageData, PageData
from .page_layout import PageLayout
from .paged_kvcache_ops import as_words

Pages = array | Sequence[int]  # page ids; the pool hands out array("q")


class DevicePagePool:
    """Pages of `layout` on `device`, handed out and taken back by page id (no user bookkeeping)."""

    def __init__(self, layout: PageLayout, num_pages: int, device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = device
        # Zeroed so that a kernel reading a whole page (masked) never meets NaN garbage. One page more
        # than the pool hands out: the sink, where padding rows of a bucketed batch append their K/V, and
        # where a user's released pages point (kvcache/read_window.py: keys read only under a window's mask).
        self.kv = torch.zeros(
            (layout.num_layers, 2, num_pages + 1, layout.page_size, layout.num_heads, layout.head_dim),
            dtype=layout.dtype,
            device=device,
        )
        self.times = torch.zeros((num_pages + 1, layout.page_size), dtype=torch.int64, device=device)
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
        self._onload_events = OnloadEvents(layout.num_layers, device)

    # --- views ---
    @property
    def sink_slot(self) -> int:
        """A slot of the sink page: never handed out; written by padding, read only as masked keys."""
        return self.num_pages * self.layout.page_size

    def k_cache(self, layer: int) -> Tensor:
        return self.kv[layer, 0]

    def v_cache(self, layer: int) -> Tensor:
        return self.kv[layer, 1]

    def times_cache(self) -> Tensor:
        return self.times

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
        # Highest first, so that the stack hands the pages out again lowest first: a user's pages stay runs
        # of consecutive ids, which onloads from an encoded tier decode in one piece each.
        self._free.extend(np.sort(idx)[::-1].tolist())

    def free_pages(self) -> list[int]:
        return list(self._free)

    # --- page moves ---
    def mark_written(self) -> None:
        """Record that the pool writes issued so far on the current stream are ones later copies must see.

        The manager calls it at commit (after the appends); `copy_out`, on the offload stream, waits
        for the latest mark and for the last onload. No-op on CPU.
        """
        if self._cuda:
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(self.device))

    def copy_out(self, pages: Pages, dst: PageData) -> None:
        """Copy `pages` into `dst` (len(pages) pages, any device and strides); returns when dst holds them.

        On CUDA one gather (layer-major) and the device-to-host copies (one per layer when each
        layer of dst is contiguous, as in the in-memory tier) run on a side stream, after the last
        `mark_written` and the last onload, and this call waits for them: freeing the pages
        afterwards is safe.
        """
        if not self._cuda:
            idx = self._index(pages)
            if dst.kv.device == self.device:
                _index_select_into(self._layer_rows(), idx, _pool_order(dst.kv))
                torch.index_select(self.times, 0, idx, out=dst.times)
            else:  # another accelerator: gather there, then a blocking copy
                dst.kv.copy_(self._gather(idx).transpose(0, 1).reshape(dst.kv.shape))
                dst.times.copy_(self.times.index_select(0, idx))
            return
        stream = self._offload_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for event in (self._written, self._onload_events.last):
                if event is not None:
                    stream.wait_event(event)
            idx = self._index(pages)
            staged = self._gather(idx)  # [L, k, 2, S*H*D]
            kv = dst.kv
            if _layers_contiguous(kv):
                for layer in range(self.layout.num_layers):
                    kv[:, layer].copy_(staged[layer].view(kv[:, layer].shape), non_blocking=True)
            else:
                kv.copy_(staged.transpose(0, 1).reshape(kv.shape), non_blocking=True)
            dst.times.copy_(self.times.index_select(0, idx), non_blocking=True)
        stream.synchronize()

    def copy_in(self, moves: Sequence[tuple[Pages, HostPageData]]) -> None:
        """Write each `src` (len(pages) pages, any device and strides) into its `pages`. Encoded pages
        (`EncodedPageData`) are decoded straight into the pool's pages: on the CPU by their codec's host
        decode, on CUDA by `decode_to_pages` (for int8 the encoded bytes cross the bus, about a quarter of
        fp32's, and one Triton launch per run of layers writes every layer's values into the pages).

        On CUDA the copies run on the onload stream, after the work already queued on the current
        stream (the pages may have been freed by a batch still computing there): first the encoded
        moves, whole, then the times of the other moves, then layer by layer: layer l of every other
        move goes into a staging buffer (one transfer per move: an asynchronous DMA from pinned host
        memory whose layers are contiguous, as the in-memory tier's; other sources are copied whole
        first), is scattered into the pages, and an event is recorded (layer 0's covers the times and
        the encoded moves).
        Returns at once. Compute waits for layer l on the device when it asks for layer l's pages
        (`wait_for_layer`); the host memory read must stay unchanged until `sync_onloads` (the
        manager calls it before any tier write).
        """
        if not self._cuda:
            rows = self._layer_rows()
            for pages, src in moves:
                if isinstance(src, EncodedPageData):
                    self._decode_in(pages, src)
                    continue
                idx = self._index(pages)
                _index_copy_into(rows, idx, _pool_order(src.kv.to(self.device)))
                self.times.index_copy_(0, idx, src.times.to(self.device))
            return
        stream = self._onload_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        lay = self.layout
        encoded = [(pages, src) for pages, src in moves if isinstance(src, EncodedPageData)]
        plain = [(pages, src) for pages, src in moves if not isinstance(src, EncodedPageData)]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if encoded:  # one staging of every encoded move's page ids, then each decodes into its pages
                ids = self._index(np.concatenate([np.asarray(pages, dtype=np.int64) for pages, _ in encoded]))
                start = 0
                for pages, src in encoded:
                    src.decode_to_pages(self.kv, self.times, ids[start : start + len(pages)])
                    start += len(pages)
            if plain:
                idx = self._index(np.concatenate([np.asarray(pages, dtype=np.int64) for pages, _ in plain]))
                times = torch.cat([src.times.to(self.device, non_blocking=True) for _, src in plain])
                self.times.index_copy_(0, idx, times)
                sources = [src.kv if _layers_contiguous(src.kv) else src.kv.to(self.device, non_blocking=True)
                           for _, src in plain]
                # One layer of every move at a time, reused by every layer (stream order keeps it safe).
                staging = torch.empty(
                    (idx.numel(), 2, lay.page_size, lay.num_heads, lay.head_dim), dtype=lay.dtype, device=self.device
                )
            rows = self._layer_rows()
            for layer in range(lay.num_layers):
                if plain:
                    start = 0
                    for src in sources:
                        staging[start : start + src.shape[0]].copy_(src[:, layer], non_blocking=True)
                        start += src.shape[0]
                    rows[layer].index_copy_(1, idx, staging.flatten(2).transpose(0, 1))  # [2, k, S*H*D]
                self._onload_events.record(layer, stream)

    def _decode_in(self, pages: Pages, src: EncodedPageData) -> None:
        """Decode `src` straight into `pages`, one decode per run of consecutive page ids (the free list
        hands out runs): each value is written once, into the pool."""
        idx = np.asarray(pages, dtype=np.int64)
        cuts = np.flatnonzero(np.diff(idx) != 1) + 1
        for start, stop in zip([0, *cuts.tolist()], [*cuts.tolist(), len(idx)]):
            first = int(idx[start])
            span = slice(first, first + stop - start)
            dst = PageData(self.kv[:, :, span].permute(2, 0, 1, 3, 4, 5), self.times[span])
            src.page_range(start, stop).decode_into(dst)

    def wait_for_layer(self, layer: int) -> None:
        """Make the current stream wait (on the device, the host does not block) for layer `layer` of the
        onloads issued so far, and for nothing else. Not while capturing a CUDA graph."""
        self._onload_events.wait_for_layer(layer)

    def wait_for_onloads(self) -> None:
        """Make the current stream wait for every layer of the onloads issued so far (a graph replay)."""
        self._onload_events.wait_for_all()

    def sync_onloads(self) -> None:
        """Block until the onloads issued so far have read their host memory (before it is rewritten)."""
        self._onload_events.synchronize()

    @property
    def _page_numel(self) -> int:
        lay = self.layout
        return lay.page_size * lay.num_heads * lay.head_dim

    def _index(self, pages: Pages) -> Tensor:
        # Asynchronous on CUDA (the ids are staged when the copy is issued): a blocking copy would make
        # the host wait for every copy queued on the stream before it.
        return torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(self.device, non_blocking=True)

    def _layer_rows(self) -> Tensor:
        """The pool as [L, 2, num_pages + 1, S*H*D]: a page of one layer's K (or V) is one row."""
        lay = self.layout
        return self.kv.view(lay.num_layers, 2, self.num_pages + 1, self._page_numel)

    def _gather(self, idx: Tensor) -> Tensor:
        """Pages `idx` of every layer, [L, k, 2, S*H*D] on the pool's device: a layer's pages are one block."""
        rows = self._layer_rows()
        num_layers, _, _, row = rows.shape
        out = torch.empty((num_layers, idx.numel(), 2, row), dtype=rows.dtype, device=rows.device)
        _index_select_into(rows, idx, out.transpose(1, 2))
        return out


def _pool_order(pages: Tensor) -> Tensor:
    """[k, L, 2, S, H, D] pages (any strides, with each page row S, H, D dense) -> a [L, 2, k, S*H*D] view.

    One `as_strided` rather than a flatten and a permute: offloads and onloads run per user on the
    serving path, which counts its ops.
    """
    k, num_layers, _, page_size, heads, head_dim = pages.shape
    stride = pages.stride()
    dense = (heads * head_dim, head_dim, 1)
    if any(size > 1 and got != want for size, got, want in zip(pages.shape[3:], stride[3:], dense)):
        raise ValueError(f"pages need dense page rows (page_size, heads, head_dim), got strides {stride}")
    return pages.as_strided(
        (num_layers, 2, k, page_size * heads * head_dim), (stride[1], stride[2], stride[0], 1), pages.storage_offset()
    )


def _layers_contiguous(pages: Tensor) -> bool:
    """Is each layer of these [k, L, 2, S, H, D] pages one contiguous block (one copy per layer)?"""
    return pages[:, 0].is_contiguous()


def _index_select_into(rows: Tensor, idx: Tensor, out: Tensor) -> None:
    """out = rows[:, :, idx] in one pass (as 16-byte words on CPU); rows, out: [L, 2, *, S*H*D]."""
    words = as_words(rows, out) if rows.device.type == "cpu" else None
    if words is None:
        torch.index_select(rows, 2, idx, out=out)
    else:
        torch.index_select(words[0], 2, idx, out=words[1])


def _index_copy_into(rows: Tensor, idx: Tensor, src: Tensor) -> None:
    """rows[:, :, idx] = src in one pass (as 16-byte words on CPU); rows, src: [L, 2, *, S*H*D]."""
    words = as_words(rows, src) if rows.device.type == "cpu" else None
    if words is None:
        rows.index_copy_(2, idx, src)
    else:
        words[0].index_copy_(2, idx, words[1])
