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
* Each entry carries an opaque `tag` (the model stores a digest of the events the K/V were
  computed from), stored atomically with the entry and returned by `info` and `read`: a reader
  that expects another tag recomputes instead of reusing K/V of a rewritten history.
* The storage is not thread-safe; its one caller (the manager) serialises calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import NamedTuple

from torch import Tensor

from .config import PageLayout
from .page_io import check_write, new_pages

# Fills a host tensor [k, *page_shape] with pages; returns once the tensor holds them.
PageFill = Callable[[Tensor], None]


class HostEntry(NamedTuple):
    start_pos: int
    length: int
    tag: bytes = b""  # the writer's fingerprint of what the K/V were computed from (opaque here)


class HostPages(NamedTuple):
    start_pos: int
    length: int
    pages: Tensor  # [ceil(length / page_size), *page_shape], valid until the next write of this user
    tag: bytes = b""

    @property
    def entry(self) -> HostEntry:
        return HostEntry(self.start_pos, self.length, self.tag)


class HostWriteResult(NamedTuple):
    stored: bool  # False: the user does not fit in the whole tier; its entry is unchanged
    evicted: tuple[tuple[int, HostEntry], ...]  # users this write dropped to make room, with what they held


class TierDataError(RuntimeError):
    """A tier found its stored data invalid (checksum, size, malformed metadata) and dropped the entry.

    Raised by tiers that report bad data rather than hide it; `FailOpenStorage` counts it as a
    corrupt read and serves a miss.
    """


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
        """The user's pages, or None. Marks the user recently used.

        The pages may be a view of the tier's memory: valid until the next `write` or `drop` on
        the storage (reads of other users keep it valid: the manager reads a batch, then onloads it).
        """

    @abstractmethod
    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        """Store pages `[first_page, ceil(length / page_size))` of the user, keeping pages before `first_page`.

        `first_page > 0` requires an entry with the same `start_pos` holding at least
        `first_page` pages (a ValueError otherwise: the caller's bookkeeping is wrong).
        `fill(dst)` writes the pages into `dst` ([k, *page_shape] on the host). The tier may
        drop other users to make room and says which, but never `user_id` nor the users in
        `protect` (the caller is about to read them). A user that does not fit beside the
        protected ones is not stored (`stored=False`, nothing changed). If `fill` raises, the
        user's entry is dropped (it may be half-written) and the exception propagates.
        `dst` stays readable, holding the pages, until the next call to the storage (a tier chain
        copies it on to the next tier). The entry then carries `tag` (replacing the old one).
        """

    @abstractmethod
    def drop(self, user_id: int) -> bool:
        """Forget the user; True if it was stored."""

    def counters(self) -> dict[str, int]:
        """Event counters of this tier and of the tiers it wraps, summed by name
        (`failures`, `timeouts`, `corrupt_reads`, ...); what `CacheStats` reports as `tier_*`."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional: a tier holding no resources has nothing to do)
        """Release files, connections and threads. The manager closes the storage it built."""


def sum_counters(*counters: dict[str, int]) -> dict[str, int]:
    """Counters of several tiers, summed by name."""
    out: dict[str, int] = {}
    for c in counters:
        for name, value in c.items():
            out[name] = out.get(name, 0) + value
    return out


class _Entry:
    __slots__ = ("buffer", "length", "start_pos", "tag")

    def __init__(self, start_pos: int, length: int, buffer: Tensor) -> None:
        self.start_pos = start_pos
        self.length = length
        self.tag = b""
        self.buffer = buffer  # [capacity_pages, *page_shape]; pages [0, ceil(length / S)) are valid


def size_class(pages: int) -> int:
    """Round a buffer size up to 4 classes per octave (<= 25% slack), so that freed buffers get reused."""
    if pages <= 4:
        return pages
    step = 1 << (pages.bit_length() - 3)
    return -(-pages // step) * step


class InMemoryHostStorage(HostKVStorage):
    """Host RAM tier bounded by `capacity_bytes`, with its own LRU over users.

    Each user has one contiguous page-major buffer, so an offload or onload of a user is one
    copy into or out of it. Buffer sizes come in classes (4 per octave) and grow geometrically
    when there is room, so appends after each visit cost amortised O(new pages).

    Memory: pageable buffers of dropped users are kept (within the capacity) and reused for
    later writes of the same size class: a tier at capacity then recycles warm memory instead
    of faulting fresh pages in at every write. Pinned buffers (`pin_memory`, for CUDA devices)
    are returned to torch's caching host allocator instead, which recycles them and also knows
    when in-flight asynchronous copies still use them. `bytes_used` counts the buffers of
    stored users; idle buffers count against the capacity too and are released first.
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool = False) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}.")
        self._capacity = int(capacity_bytes)
        self._pin = bool(pin_memory)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._live = 0  # bytes of stored users' buffers
        self._idle: dict[int, list[Tensor]] = {}  # capacity in pages -> reusable buffers
        self._idle_bytes = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def bytes_used(self) -> int:
        return self._live

    @property
    def num_users(self) -> int:
        return len(self._entries)

    def info(self, user_id: int) -> HostEntry | None:
        e = self._entries.get(user_id)
        return None if e is None else HostEntry(e.start_pos, e.length, e.tag)

    def read(self, user_id: int) -> HostPages | None:
        e = self._entries.get(user_id)
        if e is None:
            return None
        self._entries.move_to_end(user_id)
        return HostPages(e.start_pos, e.length, e.buffer[: self.layout.num_pages(e.length)], e.tag)

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        layout = self.layout
        old = self._entries.get(user_id)
        held = None if old is None else HostEntry(old.start_pos, old.length, old.tag)
        num_pages = check_write(layout, user_id, start_pos, length, first_page, held)
        evicted: tuple[tuple[int, HostEntry], ...] = ()
        if old is not None and old.buffer.shape[0] >= num_pages:
            buffer = old.buffer  # rewrite in place
        else:
            pinned = sum(self._entries[u].buffer.nbytes for u in set(protect) if u != user_id and u in self._entries)
            room = self._capacity - pinned  # what this user may occupy
            if num_pages * layout.page_nbytes > room:
                return HostWriteResult(False, ())
            old_bytes = 0 if old is None else old.buffer.nbytes
            pages = size_class(num_pages)
            if old is not None:  # grow geometrically when that needs no eviction
                grown = size_class(max(num_pages, 2 * old.buffer.shape[0]))
                if self._live - old_bytes + grown * layout.page_nbytes <= self._capacity:
                    pages = grown
            if pages * layout.page_nbytes > room:
                pages = num_pages
            buffer, evicted = self._take(pages, old_bytes, keep={user_id, *protect})
            if old is None:
                old = self._entries[user_id] = _Entry(start_pos, 0, buffer)
            else:
                if first_page > 0:
                    buffer[:first_page].copy_(old.buffer[:first_page])
                self._release(old.buffer)
                old.buffer = buffer
        try:
            fill(buffer[first_page:num_pages])
        except BaseException:
            self.drop(user_id)
            raise
        old.start_pos, old.length, old.tag = start_pos, length, bytes(tag)
        self._entries.move_to_end(user_id)
        return HostWriteResult(True, evicted)

    def drop(self, user_id: int) -> bool:
        e = self._entries.pop(user_id, None)
        if e is None:
            return False
        self._release(e.buffer)
        return True

    def _take(self, pages: int, credit: int, keep: set[int]) -> tuple[Tensor, tuple[tuple[int, HostEntry], ...]]:
        """A buffer of `pages` pages, counted as live: an idle one of that size, or a new one once there is room.

        Room is made by releasing idle buffers, then by evicting least recently used users not in
        `keep`. `credit`: live bytes about to be released by the caller (the buffer being replaced).
        """
        evicted = []
        nbytes = pages * self.layout.page_nbytes
        while True:
            if pages in self._idle:
                buffer = self._pop_idle(pages)
                break
            if self._live - credit + self._idle_bytes + nbytes <= self._capacity:
                buffer = new_pages(self.layout, pages, pin_memory=self._pin)
                break
            if self._idle:
                self._pop_idle(max(self._idle))  # released to the allocator
                continue
            victim = next(u for u in self._entries if u not in keep)  # exists: the caller checked the room
            e = self._entries[victim]
            evicted.append((victim, HostEntry(e.start_pos, e.length, e.tag)))
            self.drop(victim)
        self._live += nbytes
        return buffer, tuple(evicted)

    def _pop_idle(self, pages: int) -> Tensor:
        buffers = self._idle[pages]
        buffer = buffers.pop()
        if not buffers:
            del self._idle[pages]
        self._idle_bytes -= buffer.nbytes
        return buffer

    def _release(self, buffer: Tensor) -> None:
        """A buffer leaves a user: keep it for reuse while it fits in the capacity (pageable memory only)."""
        self._live -= buffer.nbytes
        if not self._pin and self._live + self._idle_bytes + buffer.nbytes <= self._capacity:
            self._idle.setdefault(buffer.shape[0], []).append(buffer)
            self._idle_bytes += buffer.nbytes
