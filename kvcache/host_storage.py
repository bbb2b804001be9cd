"""The host tier: per-user KV pages kept off the device.

`HostKVStorage` is the contract every tier implements (this in-memory one; a persistent
local store and a shared key-value store later). It speaks in pages of a `PageLayout`:

* A user's entry is `(start_pos, length, pages[0:n])` with `n = ceil(length / page_size)`;
  page i holds token positions `[start_pos + i * page_size, start_pos + (i + 1) * page_size)`,
  the last page possibly partial. An entry is always a valid prefix of what the device held
  for that user: a tier may drop a whole entry, never return part of one or stale data.
* A page is `[num_layers, 2, page_size, num_heads, head_dim]` (K and V of all layers), so
  pages move as `[k, *page_shape]` tensors (page-major: each page is one contiguous blob).
* Writes are incremental: `write(user, start_pos, length, first_page, fill)` replaces pages
  `[first_page, ceil(length / page_size))` and keeps pages `[0, first_page)` — offloading
  after a visit writes only the rewritten last partial page and the new ones.
* The storage is not thread-safe; its one caller (the manager) serialises calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .config import PageLayout

# Fills a host tensor [k, *page_shape] with pages; returns once the tensor holds them.
PageFill = Callable[[Tensor], None]


class HostEntry(NamedTuple):
    start_pos: int
    length: int


class HostPages(NamedTuple):
    start_pos: int
    length: int
    pages: Tensor  # [ceil(length / page_size), *page_shape], valid until the next write of this user


class HostWriteResult(NamedTuple):
    stored: bool  # False: the user does not fit in the whole tier; its entry is unchanged
    evicted: tuple[tuple[int, HostEntry], ...]  # users this write dropped to make room, with what they held


class HostKVStorage(ABC):
    """Per-user KV pages on the host; see the module docstring for the contract."""

    _layout: PageLayout | None = None

    def bind(self, layout: PageLayout) -> None:
        """Fix the page layout (the manager calls this once). A tier holding pages of another layout
        (a persistent store written by another model) must refuse here, not return wrong-shaped data."""
        if self._layout is not None and self._layout != layout:
            raise ValueError(f"Host storage is bound to {self._layout}, cannot rebind to {layout}.")
        self._layout = layout

    @property
    def layout(self) -> PageLayout:
        if self._layout is None:
            raise RuntimeError("Host storage is not bound to a page layout yet; call bind(layout).")
        return self._layout

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def bytes_used(self) -> int: ...

    @property
    @abstractmethod
    def num_users(self) -> int: ...

    @abstractmethod
    def info(self, user_id: int) -> HostEntry | None:
        """What is stored for the user, without reading it (and without touching recency)."""

    @abstractmethod
    def read(self, user_id: int) -> HostPages | None:
        """The user's pages, or None. Marks the user recently used."""

    @abstractmethod
    def write(self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill) -> HostWriteResult:
        """Store pages `[first_page, ceil(length / page_size))` of the user, keeping pages before `first_page`.

        `first_page > 0` requires an entry with the same `start_pos` holding at least
        `first_page` pages (a ValueError otherwise: the caller's bookkeeping is wrong).
        `fill(dst)` writes the pages into `dst` ([k, *page_shape] on the host). The tier may
        drop other users (never `user_id`) to make room and says which; a user larger than
        the whole tier is not stored (`stored=False`, entry unchanged). If `fill` raises, the
        user's entry is dropped (it may be half-written) and the exception propagates.
        """

    @abstractmethod
    def drop(self, user_id: int) -> bool:
        """Forget the user; True if it was stored."""


class _Entry:
    __slots__ = ("start_pos", "length", "buffer")

    def __init__(self, start_pos: int, length: int, buffer: Tensor) -> None:
        self.start_pos = start_pos
        self.length = length
        self.buffer = buffer  # [capacity_pages, *page_shape]; pages [0, ceil(length / S)) are valid


class InMemoryHostStorage(HostKVStorage):
    """Host RAM tier bounded by `capacity_bytes`, with its own LRU over users.

    Each user has one contiguous page-major buffer, so an offload or onload of a user is one
    copy into or out of it. Buffers grow geometrically when there is free room (appends after
    each visit then cost amortised O(new pages)), exactly otherwise. `bytes_used` counts
    allocated buffers. Buffers are pinned when `pin_memory` (CUDA devices) so that copies
    can be asynchronous.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}.")
        self._capacity = int(capacity_bytes)
        self._pin = bool(pin_memory)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def bytes_used(self) -> int:
        return self._bytes

    @property
    def num_users(self) -> int:
        return len(self._entries)

    def info(self, user_id: int) -> HostEntry | None:
        e = self._entries.get(user_id)
        return None if e is None else HostEntry(e.start_pos, e.length)

    def read(self, user_id: int) -> HostPages | None:
        e = self._entries.get(user_id)
        if e is None:
            return None
        self._entries.move_to_end(user_id)
        return HostPages(e.start_pos, e.length, e.buffer[: self.layout.num_pages(e.length)])

    def write(self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill) -> HostWriteResult:
        layout = self.layout
        num_pages = layout.num_pages(length)
        if length <= 0 or not 0 <= first_page < num_pages:
            raise ValueError(f"User {user_id}: cannot write pages [{first_page}, {num_pages}) for {length} tokens.")
        old = self._entries.get(user_id)
        if first_page > 0 and (old is None or old.start_pos != start_pos or layout.num_pages(old.length) < first_page):
            held = None if old is None else HostEntry(old.start_pos, old.length)
            raise ValueError(
                f"User {user_id}: writing from page {first_page} at start {start_pos} would leave a gap; host holds {held}."
            )
        if num_pages * layout.page_nbytes > self._capacity:
            return HostWriteResult(False, ())

        evicted: tuple[tuple[int, HostEntry], ...] = ()
        if old is not None and old.buffer.shape[0] >= num_pages:
            buffer = old.buffer  # rewrite in place
        else:
            old_bytes = 0 if old is None else old.buffer.nbytes
            capacity_pages = num_pages
            if old is not None:  # grow geometrically when that needs no eviction
                grown = max(num_pages, 2 * old.buffer.shape[0])
                if self._bytes - old_bytes + grown * layout.page_nbytes <= self._capacity:
                    capacity_pages = grown
            evicted = self._make_room(capacity_pages * layout.page_nbytes - old_bytes, keep=user_id)
            buffer = torch.empty((capacity_pages, *layout.page_shape), dtype=layout.dtype, pin_memory=self._pin)
            if old is not None and first_page > 0:
                buffer[:first_page].copy_(old.buffer[:first_page])
            self._bytes += buffer.nbytes - old_bytes
            if old is None:
                old = self._entries[user_id] = _Entry(start_pos, 0, buffer)
            old.buffer = buffer
        try:
            fill(buffer[first_page:num_pages])
        except BaseException:
            self.drop(user_id)
            raise
        old.start_pos, old.length = start_pos, length
        self._entries.move_to_end(user_id)
        return HostWriteResult(True, evicted)

    def drop(self, user_id: int) -> bool:
        e = self._entries.pop(user_id, None)
        if e is None:
            return False
        self._bytes -= e.buffer.nbytes
        return True

    def _make_room(self, nbytes: int, keep: int) -> tuple[tuple[int, HostEntry], ...]:
        """Drop least recently used users other than `keep` until `nbytes` more fit."""
        evicted = []
        while self._bytes + nbytes > self._capacity:
            victim = next(u for u in self._entries if u != keep)  # exists: the write fits in the whole tier
            e = self._entries[victim]
            evicted.append((victim, HostEntry(e.start_pos, e.length)))
            self.drop(victim)
        return tuple(evicted)
