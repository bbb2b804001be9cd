"""Residency: which users' K/V the device holds, and the moves between device pages and the tiers.

The manager's state machine (docs/kvcache.md) changes a user's residency only through here:
onload (tier -> fresh device pages), offload (device -> tiers, incremental), evict (offload
first, then free the pages), drop, prefetch, and making room for a batch in eviction-policy
order. Users in flight are never moved; the manager's lock is held for every call.

A user is, at any time, in one of these states:

* unknown: nothing cached in any tier;
* resident: its committed tokens `[start_pos, start_pos + length)` are in device pages
  (`pages[i]` holds tokens `start_pos + i * page_size ...`; with a read window, the pages of tokens
  no query reads again are the pool's sink page, kvcache/page_release.py), and the host may hold a prefix;
* host-only: evicted from the device, the host tier holds `(start_pos, length)`;
* in flight: resident, with a prepared but uncommitted batch; its extra pages are reserved
  and its length only moves at commit.
"""
from __future__ import annotations

import itertools
from array import array
from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from . import paged_kvcache_ops
from .cache_version import FROM_HOST, NOTHING, CacheVersion, Residence
from .events import CacheEvents
from .metadata import token_slots
from .offload_staging import OffloadStaging, OffloadWrite, plan_offload
from .page_data import PageData, decoded
from .page_layout import PageLayout
from .page_release import PageRelease
from .policy import EvictionPolicy
from .pool import DevicePagePool
from .read_window import ReadWindow, zero_unread
from .resident import Resident
from .storage import HostEntry, HostKVStorage, HostPages

_NOTHING = HostEntry(0, 0)


class Onload(NamedTuple):
    """A user to onload: what its tier returned, and the fresh device pages it goes into."""

    user_id: int
    host: HostPages
    pages: array


class Residency:
    """Resident users over a device page pool, an eviction policy and a storage tier (not thread-safe)."""

    def __init__(
        self, layout: PageLayout, pool: DevicePagePool, host: HostKVStorage, policy: EvictionPolicy,
        events: CacheEvents, counters: dict[str, int], in_flight: set[int], stage_offloads: bool = False,
        read_window: ReadWindow | None = None, compact_unread: bool = False,
    ) -> None:
        """`read_window`: offloads write zeros for the tokens it says are never read again, and with
        `compact_unread` (a codec that stores zeros in few bytes) rewrite pages that went unread."""
        self.layout = layout
        self.pool = pool
        self.host = host
        self.policy = policy
        self._events = events
        self._counters = counters
        self.in_flight = in_flight  # the manager's: users with a prepare pending
        self.users: dict[int, Resident] = {}
        self.offload_requested: set[int] = set()  # async offloads not yet run
        self.staging = OffloadStaging(layout, pinned=pool.device.type == "cuda") if stage_offloads else None
        self.read_window = read_window
        self.release = PageRelease(read_window, layout, pool.num_pages)
        self._compact = read_window if compact_unread else None

    def live_pages(self, res: Resident) -> int:
        """Device pages the user owns (its page list less the released entries)."""
        return self.release.live_pages(res.length, listed=len(res.pages))

    def release_unread(self, res: Resident, before: int) -> None:
        """Free the user's device pages that hold unread tokens only, now that a commit grew it from
        `before` tokens."""
        start, stop = self.release.newly_released(before, res.length)
        if start < stop:
            self.pool.free(res.pages[start:stop])
            res.pages[start:stop] = array("q", [self.pool.num_pages]) * (stop - start)

    def cached_entry(self, u: int) -> HostEntry:
        """What is reusable for the user: the device's committed tokens, else the host's entry, else (0, 0)."""
        res = self.users.get(u)
        if res is not None and res.length:
            return HostEntry(res.start_pos, res.length, res.tag)
        h = self.host.info(u) if res is None else None
        return h if h is not None else _NOTHING

    def version(self, u: int) -> CacheVersion:
        """The user's reusable tokens as `cached_entry` reports them, with the generation of their commit."""
        res = self.users.get(u)
        if res is not None and res.length:
            return CacheVersion(res.start_pos, res.length, res.tag, res.generation)
        h = self.host.info(u) if res is None else None
        return CacheVersion(h.start_pos, h.length, h.tag, FROM_HOST) if h is not None else NOTHING

    def residence(self, u: int) -> Residence:
        """`version` and where it lives, asking the host tiers once (a device-resident user's best host
        entry is what a stale device copy is measured against)."""
        res = self.users.get(u)
        if res is not None and res.length:
            best = self.host.info(u)
            return Residence(CacheVersion(res.start_pos, res.length, res.tag, res.generation), True, None, _span(best))
        h = self.host.info(u) if res is None else None
        if h is None:
            return Residence(NOTHING, False, None, None)
        return Residence(CacheVersion(h.start_pos, h.length, h.tag, FROM_HOST), False, _span(self.host.own_info(u)), _span(h))

    def read_kv(self, u: int, layer: int) -> tuple[Tensor, Tensor]:
        """The user's committed K and V of one layer, [length, H, D] copies on the device, from the
        device pages or else the host tier (empty when neither holds the user)."""
        lay, pool = self.layout, self.pool
        res = self.users.get(u)
        if res is not None and res.length:
            pool.wait_for_layer(layer)
            idx = self._committed_slots(res)
            return paged_kvcache_ops.gather_kvcache(pool.k_cache(layer), pool.v_cache(layer), idx)
        hp = self.host.read(u) if self.host.info(u) is not None else None
        if hp is None:
            empty = torch.zeros((0, lay.num_heads, lay.head_dim), dtype=lay.dtype, device=pool.device)
            return empty, empty.clone()
        kv = decoded(hp.pages).kv[:, layer].transpose(0, 1).reshape(2, -1, lay.num_heads, lay.head_dim)[:, : hp.length]
        kv = kv.to(pool.device, copy=True)
        return kv[0], kv[1]

    def read_times(self, u: int) -> Tensor:
        """The user's committed tokens' times, [length] int64 on the device, from the device pages or else
        the host tier (empty when neither holds the user)."""
        pool = self.pool
        res = self.users.get(u)
        if res is not None and res.length:
            pool.wait_for_layer(0)
            return pool.times_cache().view(-1).index_select(0, self._committed_slots(res))
        hp = self.host.read(u) if self.host.info(u) is not None else None
        if hp is None:
            return torch.zeros(0, dtype=torch.int64, device=pool.device)
        return decoded(hp.pages).times.reshape(-1)[: hp.length].to(pool.device, copy=True)

    def _committed_slots(self, res: Resident) -> Tensor:
        pages = np.asarray(res.pages, dtype=np.int64)
        slots = token_slots(pages, np.array([len(pages)]), np.array([0]), np.array([res.length]), self.layout.page_size)
        return torch.from_numpy(slots).to(self.pool.device)

    def prefetch(self, user_ids: list[int]) -> int:
        """Onload the host-only users among `user_ids` whose pages can be freed without evicting one of
        them or a user in flight; returns how many were onloaded."""
        wanted: dict[int, HostEntry] = {}
        for u in user_ids:
            if u not in self.users and u not in wanted:
                h = self.host.info(u)
                if h is not None:
                    wanted[u] = h
        if not wanted:
            return 0
        room = self.pool.num_free + self.evictable_pages(exclude=wanted.keys())
        need = 0
        for u, h in list(wanted.items()):
            pages = self.release.live_pages(h.length)
            if need + pages > room:
                del wanted[u]  # a later, smaller user may still fit
            else:
                need += pages
        if need > self.pool.num_free:
            self.evict_for(need, batch=set(wanted), protect=wanted.keys())
        self.pool.sync_onloads()  # a read may promote into host memory an onload still reads
        moves = []
        for u, h in wanted.items():
            hp = self.host.read(u)
            if hp is None or hp.entry != h:
                continue  # lost or changed meanwhile: the next prepare finds out and re-plans
            fresh = self.pool.alloc(self.release.live_pages(hp.length))
            moves.append(Onload(u, hp, self.release.onload_pages(hp.length, fresh)))
        try:
            self.onload(moves)
        except BaseException:  # the users not admitted yet own none of their pages
            for move in moves:
                if move.user_id not in self.users:
                    self.pool.free(self.release.owned(move.pages))
            raise
        return len(moves)

    def evictable_pages(self, exclude: Collection[int]) -> int:
        return sum(self.live_pages(res) for u, res in self.users.items() if u not in self.in_flight and u not in exclude)

    def evict_for(self, pages_needed: int, batch: set[int], protect: Collection[int]) -> None:
        """Evict users (never the batch or users in flight) until `pages_needed` pages are free.

        Victims are offloaded first; their host writes must not push `protect` out of the host.
        """
        victims, free = [], self.pool.num_free
        for u in self.policy.order():
            if free >= pages_needed:
                break
            if u not in batch and u not in self.in_flight:
                victims.append(u)
                free += self.live_pages(self.users[u])
        self.offload_users(victims, protect)
        for u in victims:
            self.evict(u, offload=False, protect=protect)

    def evict(self, u: int, offload: bool, protect: Collection[int] = ()) -> None:
        """Drop a resident user from the device, offloading first if asked (or if an async offload is pending)."""
        if offload or u in self.offload_requested:
            self.offload(u, protect)
        self.drop(u)
        self._counters["device_evictions"] += 1
        held = self.host.own_info(u)  # a shared tier is every node's fallback, not this node's holding
        if held is None:
            self._events.gone(u)
        else:
            self._events.on_host(u, held.start_pos, held.length)

    def invalidate(self, u: int) -> None:
        """Forget the user in every tier (not in flight)."""
        if u in self.users:
            self.drop(u)
        self.host.drop(u)
        self.offload_requested.discard(u)
        self._events.gone(u)

    def drop(self, u: int) -> None:
        res = self.users.pop(u)
        self.policy.remove(u)
        self.pool.free(self.release.owned(res.pages))
        self.offload_requested.discard(u)

    def onload(self, moves: Sequence[Onload]) -> None:
        """Copy the users' pages in (one pool onload for all) and make them resident."""
        self.copy_onloads(moves)
        for move in moves:
            self.admit(move)

    def copy_onloads(self, moves: Sequence[Onload]) -> None:
        """One pool onload for all the moves (on CUDA layer by layer: each layer of every user before the
        next layer, so that compute waits for the layers it reads only)."""
        if moves:  # released pages stay on the host
            self.pool.copy_in([part for m in moves for part in self.release.live_parts(m.pages, m.host.pages, m.host.length)])

    def admit(self, move: Onload) -> Resident:
        """The user, whose pages `copy_onloads` copied, resident with exactly the entry its tier returned."""
        u, hp, pages = move
        res = self.users[u] = Resident(hp.start_pos, hp.length, pages, hp.tag, synced=hp.entry)
        if self.read_window is not None:  # what any writer's compaction leaves at most unzeroed
            res.zeroed_end = self.read_window.unread_end(hp.length) - self.read_window.size
        self.policy.add(u)
        self._counters["onloaded_bytes"] += self.live_pages(res) * self.layout.page_nbytes
        self._events.on_device(u, hp.start_pos, hp.length)
        return res

    def offload(self, u: int, protect: Collection[int] = ()) -> None:
        self.offload_users([u], protect)

    def offload_users(self, user_ids: Sequence[int], protect: Collection[int] = ()) -> None:
        """Make the host hold exactly each user's committed device data, writing only what it lacks
        (`plan_offload`, kvcache/offload_staging.py). With staging (on CUDA) the users' pages leave the
        device together.

        A write that evicts users from a tier may evict the entry a later user's plan builds on: the
        users after it are planned again, and one whose plan now starts before what was staged is
        written from the device.
        """
        plans = {u: self._plan_offload(u) for u in dict.fromkeys(user_ids)}
        writes = [w for w in plans.values() if isinstance(w, OffloadWrite)]
        if writes:
            self.pool.sync_onloads()  # the tier may rewrite host memory an onload still reads
        staged: dict[int, tuple[int, PageData]] = {}  # user -> (first page staged, its staged pages)
        if self.staging is not None and writes:
            buffer = self.staging.take(sum(len(w.pages) for w in writes))
            self.pool.copy_out(array("q", [p for w in writes for p in w.pages]), buffer)
            starts = np.cumsum([0] + [len(w.pages) for w in writes]).tolist()
            staged = {w.user_id: (w.first_page, buffer[a:b]) for w, (a, b) in zip(writes, itertools.pairwise(starts))}
        replan = False
        for u, plan in plans.items():
            self.offload_requested.discard(u)
            if replan:
                plan = self._plan_offload(u)
            if plan == "superseded":
                self._counters["superseded_offloads"] += 1
            if isinstance(plan, OffloadWrite):
                replan |= self._write_offload(plan, staged.get(u), protect)

    def _write_offload(self, w: OffloadWrite, staged: tuple[int, PageData] | None, protect: Collection[int]) -> bool:
        """Write one user's planned pages (from `staged` when it holds them); returns whether the write
        evicted users from a tier."""
        res = w.resident
        if staged is not None and staged[0] <= w.first_page:
            pages = staged[1][w.first_page - staged[0] :]
            fill = lambda dst: dst.copy_(pages)
        else:
            fill = lambda dst: self.pool.copy_out(w.pages, dst)
        window = self.read_window
        if window is not None:
            unread = (window.sink, window.unread_end(res.length))
            copy = fill
            fill = lambda dst: (copy(dst), zero_unread(dst, w.first_page, unread, self.layout.page_size))
        result = self.host.write(w.user_id, res.start_pos, res.length, w.first_page, fill, protect=protect,
                                 tag=res.tag)
        if result.stored:
            res.synced = HostEntry(res.start_pos, res.length, res.tag)
            if window is not None and w.first_page * self.layout.page_size <= max(res.zeroed_end, window.sink):
                res.zeroed_end = window.unread_end(res.length)
            self._counters["offloaded_bytes"] += len(w.pages) * self.layout.page_nbytes
        else:
            self._counters["host_rejected_writes"] += 1
        self._counters["host_evictions"] += len(result.evicted)
        for v, _ in result.evicted:
            if v not in self.users:
                self._events.gone(v)
        return bool(result.evicted)

    def _plan_offload(self, u: int) -> OffloadWrite | str:
        res = self.users.get(u)
        if res is None or res.length == 0:
            return "nothing"
        return plan_offload(u, res, self.host.info(u), self.layout, self._compact)


def _span(entry: HostEntry | None) -> tuple[int, int] | None:
    return None if entry is None or not entry.length else (entry.start_pos, entry.length)
