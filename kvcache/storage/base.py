"""The tier contract: per-user KV pages kept off the device (RAM, a local directory, Redis).

`HostKVStorage` is what every tier implements and what the manager calls. It speaks in pages
of a `PageLayout`:

* A user's entry is `(start_pos, length, pages[0:n])` with `n = ceil(length / page_size)`;
  page i holds token positions `[start_pos + i * page_size, start_pos + (i + 1) * page_size)`,
  the last page possibly partial. An entry is always a valid prefix of what the device held
  for that user: a tier may drop a whole entry, never return part of one or stale data.
* A page is K and V of all layers (`[num_layers, 2, page_size, num_heads, head_dim]`) and each
  token's time (`[page_size]` int64), so pages move as `kvcache.PageData` (`kv [k, *page_shape]`,
  `times [k, page_size]`). Their strides are the tier's choice (the dims of a page row,
  `page_size, num_heads, head_dim`, dense): tiers that store bytes use page blobs (a page is one
  contiguous run of bytes); the in-memory tier hands out layer-major views (a layer of a user is
  one contiguous block, copied to the device in one DMA).
* Writes are incremental: `write(user, start_pos, length, first_page, fill)` replaces pages
  `[first_page, ceil(length / page_size))` and keeps pages `[0, first_page)`: offloading
  after a visit writes only the rewritten last partial page and the new ones.
* Each entry carries an opaque `tag` (the model stores a digest of the events the K/V were
  computed from), stored atomically with the entry and returned by `info` and `read`: a reader
  that expects another tag recomputes instead of reusing K/V of a rewritten history.
* A tier is not thread-safe; its one caller (the manager) serialises calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from typing import NamedTuple

from ..page_data import HostPageData, PageData
from ..page_layout import PageLayout

# Fills host pages (k of them) with pages; returns once they hold them.
PageFill = Callable[[PageData], None]


class HostEntry(NamedTuple):
    start_pos: int
    length: int
    tag: bytes = b""  # the writer's fingerprint of what the K/V were computed from (opaque here)


class HostPages(NamedTuple):
    start_pos: int
    length: int
    pages: HostPageData  # ceil(length / page_size) pages (maybe still encoded), valid until the next write of this user
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
    """Per-user KV pages off the device; see the module docstring for the contract."""

    _layout: PageLayout | None = None
    shared: bool = False  # other nodes read and write this tier too (Redis)

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

    def own_info(self, user_id: int) -> HostEntry | None:
        """`info` from the tiers only this node holds (none for a shared tier): where the node itself
        can serve the user from, what its cache events report."""
        return None if self.shared else self.info(user_id)

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
        `fill(dst)` writes the pages into `dst` (k pages on the host). The tier may
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


def check_write(
    layout: PageLayout, user_id: int, start_pos: int, length: int, first_page: int, held: HostEntry | None,
) -> int:
    """The number of pages of the written entry, once the write is valid against what the tier holds.

    ValueError: a bad range (`check_write_range`), or an incremental write that does not continue
    `held` (a gap: in a private tier, the caller's bookkeeping is wrong).
    """
    num_pages = check_write_range(layout, user_id, length, first_page)
    if not continues(layout, start_pos, first_page, held):
        raise ValueError(
            f"User {user_id}: writing from page {first_page} at start {start_pos} would leave a gap; "
            f"the tier holds {held}."
        )
    return num_pages


def check_write_range(layout: PageLayout, user_id: int, length: int, first_page: int) -> int:
    """The number of pages of the written entry; ValueError for no tokens or `first_page` outside it."""
    num_pages = layout.num_pages(length)
    if length <= 0 or not 0 <= first_page < num_pages:
        raise ValueError(f"User {user_id}: cannot write pages [{first_page}, {num_pages}) for {length} tokens.")
    return num_pages


def continues(layout: PageLayout, start_pos: int, first_page: int, held: HostEntry | None) -> bool:
    """Whether a write from `first_page` at `start_pos` continues `held`: a whole write (page 0) always
    does; an incremental one needs an entry at the same start holding at least `first_page` pages.
    In a shared tier a write that does not is a race (another node dropped or replaced the entry
    since this one read it), not a bug."""
    if first_page == 0:
        return True
    return held is not None and held.start_pos == start_pos and layout.num_pages(held.length) >= first_page
