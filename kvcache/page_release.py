"""PageRelease: which device pages of a user a read window frees, and the page lists that result.

With `KVCacheConfig.read_window`, a page holding only tokens no later query reads
(`ReadWindow.unread_pages`: a run of pages after the sink's, growing with the user) is given back to
the pool when a commit makes it so, and never allocated when the user is onloaded. Its entry in the
user's page list becomes the pool's sink page, so positions, slots and the page table keep their
shape (how many follows from the length: `released_count`) and attention reads the sink there, under its
window's mask. Onloads copy only the live pages; offloads read the sink for the released ones, which
`zero_unread` then zeroes. Without a read window nothing is released.

>>> from kvcache.page_layout import PageLayout
>>> import torch
>>> release = PageRelease(ReadWindow(size=4, sink=1), PageLayout(1, 1, 4, 2, torch.float32), sink_page=99)
>>> release.released(14)  # tokens [1, 10) unread: pages 1..4 hold nothing else
(1, 5)
>>> release.onload_pages(14, array("q", [7, 8, 9]))
array('q', [7, 99, 99, 99, 99, 8, 9])
"""
from __future__ import annotations

from array import array

from .page_data import HostPageData, page_range
from .page_layout import PageLayout
from .read_window import ReadWindow


class PageRelease:
    def __init__(self, window: ReadWindow | None, layout: PageLayout, sink_page: int) -> None:
        self.window = window
        self.layout = layout
        self.sink_page = sink_page

    def released(self, length: int) -> tuple[int, int]:
        """Pages [first, stop) of a `length`-token user that the device does not hold (first == stop: none)."""
        return (0, 0) if self.window is None else self.window.unread_pages(length, self.layout.page_size)

    def released_count(self, length: int) -> int:
        first, stop = self.released(length)
        return stop - first

    def live_pages(self, length: int, listed: int | None = None) -> int:
        """Device pages a `length`-token user holds: of its `listed` page-list entries (default: its
        committed pages, what an onload allocates), those that are not the sink."""
        return (self.layout.num_pages(length) if listed is None else listed) - self.released_count(length)

    def onload_pages(self, length: int, fresh: array) -> array:
        """The page list of an onloaded `length`-token user: `fresh` (its `live_pages(length)` pages) with
        the sink where its released pages are."""
        first, stop = self.released(length)
        return fresh[:first] + array("q", [self.sink_page]) * (stop - first) + fresh[first:]

    def newly_released(self, before: int, length: int) -> tuple[int, int]:
        """Pages [start, stop) of a user's page list to free now that it holds `length` tokens, not
        `before` (start >= stop: none)."""
        first, stop = self.released(length)
        return first + self.released_count(before), stop

    def live_parts(self, pages: array, host_pages: HostPageData, length: int) -> list[tuple[array, HostPageData]]:
        """(device pages, host pages) of an onload without its released pages: one part, or two around them."""
        first, stop = self.released(length)
        if first == stop:
            return [(pages, host_pages)]
        return [(pages[a:b], page_range(host_pages, a, b)) for a, b in ((0, first), (stop, len(pages))) if a < b]

    def owned(self, pages: array) -> array:
        """The pages of a page list the user owns (not the sink)."""
        return pages if self.sink_page not in pages else array("q", [p for p in pages if p != self.sink_page])
