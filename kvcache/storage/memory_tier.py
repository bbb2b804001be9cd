"""InMemoryHostStorage: the tier in host RAM, bounded by bytes, least recently used users evicted first."""
from __future__ import annotations

from collections.abc import Collection

from ..page_layout import PageLayout
from .base import HostEntry, HostPages, HostWriteResult, PageFill
from .lru import BytesBoundedTier
from .page_slab import HostPageSlab, PageRange


class _Entry:
    __slots__ = ("length", "range", "start_pos", "tag")

    def __init__(self, start_pos: int, length: int, tag: bytes, range_: PageRange) -> None:
        self.start_pos = start_pos
        self.length = length
        self.tag = tag
        self.range = range_  # slab pages; [0, ceil(length / S)) of them are valid

    @property
    def info(self) -> HostEntry:
        return HostEntry(self.start_pos, self.length, self.tag)


def size_class(pages: int) -> int:
    """Round a range up to 4 classes per octave (<= 25% slack), so that freed ranges fit later writes."""
    if pages <= 4:
        return pages
    step = 1 << (pages.bit_length() - 3)
    return -(-pages // step) * step


class InMemoryHostStorage(BytesBoundedTier):
    """Host RAM tier bounded by `capacity_bytes`, with its own LRU over users.

    All pages live in one `HostPageSlab` of `capacity_bytes`, allocated at `bind` (pinned with
    `pin_memory`, for CUDA devices) and never again: `slab.allocations` stays 1. Each user holds
    one contiguous range of it, layer-major inside (`HostPageSlab.view`), so an offload or onload
    of a user is one copy per layer, and the read pages are views with those strides. Ranges come in
    size classes (4 per octave) and grow geometrically when there is room, so appends after each
    visit cost amortised O(new pages). `bytes_used` counts the ranges of stored users.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        super().__init__(capacity_bytes)
        self._pin = bool(pin_memory)
        self.slab: HostPageSlab | None = None  # set by bind

    def bind(self, layout: PageLayout) -> None:
        super().bind(layout)
        if self.slab is None:
            self.slab = HostPageSlab(layout, self._capacity // layout.page_nbytes, self._pin)

    def read(self, user_id: int) -> HostPages | None:
        e = self._users.get(user_id)
        if e is None:
            return None
        self._users.touch(user_id)
        return HostPages(e.start_pos, e.length, self.slab.view(e.range, self.layout.num_pages(e.length)), e.tag)

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        layout = self.layout
        old, num_pages = self._checked_write(user_id, start_pos, length, first_page)
        evicted: tuple[tuple[int, HostEntry], ...] = ()
        if old is not None and old.range.pages >= num_pages:
            range_ = old.range  # rewrite in place
        else:
            room = self._capacity - self._users.protected_bytes(protect, user_id)  # what this user may occupy
            if num_pages * layout.page_nbytes > room:
                return HostWriteResult(False, ())
            range_, evicted = self._place(old, num_pages, first_page, keep={user_id, *protect})
            if range_ is None:
                return HostWriteResult(False, evicted)
        entry = _Entry(start_pos, length, bytes(tag), range_)
        self._users.put(user_id, entry, range_.pages * layout.page_nbytes)
        try:
            fill(self.slab.view(range_, num_pages, first_page))
        except BaseException:
            self.drop(user_id)
            raise
        return HostWriteResult(True, evicted)

    def drop(self, user_id: int) -> bool:
        e = self._users.pop(user_id)
        if e is None:
            return False
        self.slab.free(e.range)
        return True

    def _place(
        self, old: _Entry | None, num_pages: int, first_page: int, keep: set[int],
    ) -> tuple[PageRange | None, tuple[tuple[int, HostEntry], ...]]:
        """A range for the writer's `num_pages` pages holding its pages `[0, first_page)` (from `old`),
        evicting least recently used users not in `keep` until one fits, and the users evicted.

        No range (the writer's entry unchanged) when the users in `keep` leave no contiguous room.
        """
        slab, page_nbytes = self.slab, self.layout.page_nbytes
        pages = size_class(num_pages)
        old_bytes = 0 if old is None else old.range.pages * page_nbytes
        if old is not None:  # grow geometrically when that fits without evicting
            grown = size_class(max(num_pages, 2 * old.range.pages))
            if self.bytes_used - old_bytes + grown * page_nbytes <= self._capacity:
                pages = grown
        kept = None if old is None or first_page == 0 else slab.view(old.range, first_page).clone()
        if old is not None:
            slab.free(old.range)  # its pages are in `kept`; taken back below if nothing fits
        range_ = slab.alloc(pages) or slab.alloc(num_pages)
        evicted = []
        while range_ is None:
            victim = self._users.victim(keep)
            if victim is None:
                if old is not None:
                    slab.reserve(old.range)  # nothing was written since it was freed
                return None, tuple(evicted)
            evicted.append((victim, self._users.get(victim).info))
            self.drop(victim)
            range_ = slab.alloc(num_pages)
        if kept is not None:
            slab.view(range_, first_page).copy_(kept)
        return range_, tuple(evicted)
