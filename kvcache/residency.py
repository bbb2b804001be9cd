"""Residency: which users' K/V the device holds, and the moves between device pages and the tiers.

The manager's state machine (docs/kvcache.md) changes a user's residency only through here:
onload (tier -> fresh device pages), offload (device -> tiers, incremental), evict (offload
first, then free the pages), drop, prefetch, and making room for a batch in eviction-policy
order. Users in flight are never moved; the manager's lock is held for every call.
"""
from __future__ import annotations

from array import array
from collections.abc import Collection

from .config import PageLayout
from .events import CacheEvents
from .policy import EvictionPolicy
from .pool import DevicePagePool
from .storage import HostEntry, HostKVStorage, HostPages

_NOTHING = HostEntry(0, 0)


class Resident:
    """A user's committed tokens on the device (plus reserved pages while in flight)."""

    __slots__ = ("length", "pages", "start_pos", "synced", "tag")

    def __init__(self, start_pos: int, length: int, pages: array, tag: bytes = b"", synced: HostEntry | None = None):
        self.start_pos = start_pos
        self.length = length
        self.pages = pages
        self.tag = tag  # the caller's fingerprint of the committed tokens (travels to the host tiers)
        # The host entry this manager last wrote or onloaded for the user: an offload appends only to
        # that one, never to an entry another writer (node, process) put there meanwhile.
        self.synced = synced


class Residency:
    """Resident users over a device page pool, an eviction policy and a storage tier (not thread-safe)."""

    def __init__(
        self, layout: PageLayout, pool: DevicePagePool, host: HostKVStorage, policy: EvictionPolicy,
        events: CacheEvents, counters: dict[str, int], in_flight: set[int],
    ) -> None:
        self._layout = layout
        self._pool = pool
        self._host = host
        self._policy = policy
        self._events = events
        self._counters = counters
        self.in_flight = in_flight  # the manager's: users with a prepare pending
        self.users: dict[int, Resident] = {}
        self.offload_requested: set[int] = set()  # async offloads not yet run

    def cached_entry(self, u: int) -> HostEntry:
        """What is reusable for the user: the device's committed tokens, else the host's entry, else (0, 0)."""
        res = self.users.get(u)
        if res is not None and res.length:
            return HostEntry(res.start_pos, res.length, res.tag)
        h = self._host.info(u) if res is None else None
        return h if h is not None else _NOTHING

    def prefetch(self, wanted: dict[int, HostEntry]) -> int:
        """Onload the users (host-only, with the entries `info` reported) whose pages can be freed without
        evicting one of them or a user in flight; returns how many were onloaded."""
        room = self._pool.num_free + self.evictable_pages(exclude=wanted.keys())
        need = 0
        for u, h in list(wanted.items()):
            pages = self._layout.num_pages(h.length)
            if need + pages > room:
                del wanted[u]  # a later, smaller user may still fit
            else:
                need += pages
        if need > self._pool.num_free:
            self.evict_for(need, batch=set(wanted), protect=wanted.keys())
        self._pool.sync_onloads()  # a read may promote into host memory an onload still reads
        onloaded = 0
        for u, h in wanted.items():
            hp = self._host.read(u)
            if hp is None or hp.entry != h:
                continue  # lost or changed meanwhile: the next prepare finds out and re-plans
            self.onload(u, hp, self._pool.alloc(self._layout.num_pages(hp.length)))
            onloaded += 1
        return onloaded

    def evictable_pages(self, exclude: Collection[int]) -> int:
        return sum(len(res.pages) for u, res in self.users.items() if u not in self.in_flight and u not in exclude)

    def evict_for(self, pages_needed: int, batch: set[int], protect: Collection[int]) -> None:
        """Evict users (never the batch or users in flight) until `pages_needed` pages are free.

        Victims are offloaded first; their host writes must not push `protect` out of the host.
        """
        victims, free = [], self._pool.num_free
        for u in self._policy.order():
            if free >= pages_needed:
                break
            if u not in batch and u not in self.in_flight:
                victims.append(u)
                free += len(self.users[u].pages)
        for u in victims:
            self.evict(u, offload=True, protect=protect)

    def evict(self, u: int, offload: bool, protect: Collection[int] = ()) -> None:
        """Drop a resident user from the device, offloading first if asked (or if an async offload is pending)."""
        if offload or u in self.offload_requested:
            self.offload(u, protect)
        self.drop(u)
        self._counters["device_evictions"] += 1
        held = self._host.info(u)
        if held is None:
            self._events.gone(u)
        else:
            self._events.on_host(u, held.start_pos, held.length)

    def drop(self, u: int) -> None:
        res = self.users.pop(u)
        self._policy.remove(u)
        self._pool.free(res.pages)
        self.offload_requested.discard(u)

    def onload(self, u: int, hp: HostPages, pages: array) -> Resident:
        self._pool.copy_in(pages, hp.pages)
        res = self.users[u] = Resident(hp.start_pos, hp.length, pages, hp.tag, synced=hp.entry)
        self._policy.add(u)
        self._counters["onloaded_bytes"] += len(pages) * self._layout.page_nbytes
        self._events.on_device(u, hp.start_pos, hp.length)
        return res

    def offload(self, u: int, protect: Collection[int] = ()) -> None:
        """Make the host hold exactly the user's committed device data, writing only what it lacks.

        Incremental only on top of the entry this manager wrote or onloaded (`synced`): a shared tier
        may hold a same-start entry of another history (another node), whose pages must not be kept.
        """
        self.offload_requested.discard(u)
        res = self.users.get(u)
        if res is None or res.length == 0:
            return
        h = self._host.info(u)
        ours = HostEntry(res.start_pos, res.length, res.tag)
        if h == ours:
            res.synced = ours
            return
        num_pages = self._layout.num_pages(res.length)
        if h is not None and h == res.synced:
            # Rewrite the partial last page, then the new ones (the last page alone for a new tag).
            first = min(h.length // self._layout.page_size, num_pages - 1)
        else:
            first = 0
        pages = res.pages[first:num_pages]
        self._pool.sync_onloads()  # the tier may rewrite host memory an onload still reads
        result = self._host.write(
            u, res.start_pos, res.length, first, lambda dst: self._pool.copy_out(pages, dst),
            protect=protect, tag=res.tag,
        )
        if result.stored:
            res.synced = ours
            self._counters["offloaded_bytes"] += len(pages) * self._layout.page_nbytes
        else:
            self._counters["host_rejected_writes"] += 1
        self._counters["host_evictions"] += len(result.evicted)
        for v, _ in result.evicted:
            if v not in self.users:
                self._events.gone(v)
