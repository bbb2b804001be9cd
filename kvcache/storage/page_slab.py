"""HostPageSlab: the in-memory tier's pages, allocated once and handed out as contiguous ranges.

A host tier on a CUDA machine lives in pinned memory, so that onloads and offloads are
asynchronous DMA copies. Pinning is expensive (milliseconds per allocation, a driver call that
serialises with the GPU), so the slab is pinned once, when the tier is bound to its layout, and
every later write reuses it: no pinned allocation while serving. A user's pages are one
contiguous range of the slab, its K/V stored layer-major inside it (`[num_layers, range pages, 2,
page_size, heads, head_dim]`): one layer of a user is one contiguous block, so an onload
copies it to the device in one DMA and compute waits for that layer only. The pages' token
times are a slab of their own beside it (`[num_pages, page_size]` int64, the same page numbers).

Ranges are handed out first-fit from a sorted list of free ranges, coalesced on free. The slab
knows nothing about users; the tier decides whom to evict when no range fits.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

from torch import Tensor

from ..page_data import PageData, empty_kv, empty_times
from ..page_layout import PageLayout


class PageRange(NamedTuple):
    start: int
    pages: int


class HostPageSlab:
    """`num_pages` pages of `layout` in one host tensor (pinned when `pin_memory`)."""

    def __init__(self, layout: PageLayout, num_pages: int, pin_memory: bool) -> None:
        self.layout = layout
        self.kv: Tensor = empty_kv(layout, num_pages, pin_memory=pin_memory)  # [num_pages, *page_shape] of memory
        self.times: Tensor = empty_times(layout, num_pages, pin_memory=pin_memory)  # [num_pages, page_size]
        self.pinned = pin_memory
        self.allocations = 1  # host allocations made for pages: this one, ever
        self._starts: list[int] = [0] if num_pages else []  # free ranges, sorted by start
        self._lengths: dict[int, int] = {0: num_pages} if num_pages else {}
        self.num_free = num_pages

    def view(self, r: PageRange, stop: int | None = None, start: int = 0) -> PageData:
        """Pages `[start, stop)` of the range (all of it by default), as views of the slab: K/V with the
        range's layer-major strides (`kv[:, layer]` is contiguous), and their times.

        The K/V view is one `as_strided` (a slice and reshapes would be five ops, on a path that counts
        them): the range holds `[num_layers, r.pages, 2, page_size, heads, head_dim]`.
        """
        lay = self.layout
        row = lay.page_size * lay.num_heads * lay.head_dim  # one page of one layer's K (or V)
        stop = r.pages if stop is None else stop
        kv = self.kv.as_strided(
            (stop - start, lay.num_layers, 2, lay.page_size, lay.num_heads, lay.head_dim),
            (2 * row, r.pages * 2 * row, row, lay.num_heads * lay.head_dim, lay.head_dim, 1),
            self.kv.storage_offset() + r.start * lay.num_layers * 2 * row + start * 2 * row,
        )
        return PageData(kv, self.times[r.start + start : r.start + stop])

    def alloc(self, n: int) -> PageRange | None:
        """A free range of `n` pages (the lowest that fits), or None when none is that long."""
        for start in self._starts:
            length = self._lengths[start]
            if length >= n:
                self._take(start, length, PageRange(start, n))
                return PageRange(start, n)
        return None

    def reserve(self, r: PageRange) -> bool:
        """Take exactly `r` if it is free (a range just freed, taken back)."""
        i = bisect.bisect_right(self._starts, r.start) - 1
        if i < 0:
            return False
        start = self._starts[i]
        length = self._lengths[start]
        if start + length < r.start + r.pages:
            return False
        self._take(start, length, r)
        return True

    def free(self, r: PageRange) -> None:
        if r.pages == 0:
            return
        i = bisect.bisect_left(self._starts, r.start)
        start, length = r
        if i < len(self._starts) and self._starts[i] == start + length:  # merge with the next range
            length += self._lengths.pop(self._starts.pop(i))
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:  # and the previous
            start = self._starts[i - 1]
            self._lengths[start] += length
        else:
            self._starts.insert(i, start)
            self._lengths[start] = length
        self.num_free += r.pages

    def _take(self, start: int, length: int, r: PageRange) -> None:
        """Carve `r` out of the free range `[start, start + length)`."""
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        del self._lengths[start]
        for s, n in ((start, r.start - start), (r.start + r.pages, start + length - r.start - r.pages)):
            if n > 0:
                bisect.insort(self._starts, s)
                self._lengths[s] = n
        self.num_free -= r.pages
