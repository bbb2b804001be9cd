"""Prepared batches: what a prepare changed, applied at commit or undone at rollback.

A prepare opens a transaction (`Transactions.open`): it onloads and allocates the batch's pages,
marks its users in flight and returns the batch's metadata, whose `prepare_id` names the
transaction. `take` hands a transaction back exactly once, so a metadata object commits or
rolls back once and a foreign one is refused. The manager's lock is held for every call.
"""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass

from .cache_version import FROM_HOST
from .errors import KVCacheRequestError
from .events import CacheEvents
from .metadata import KVCacheMetadata, build_metadata
from .prepare_plan import PreparePlan
from .residency import Onload, Residency
from .resident import Resident
from .storage import HostPages

_PREPARE_IDS = itertools.count(1)  # process-wide, so a metadata object from another manager is refused too


@dataclass
class PendingPrepare:
    """What a prepare changed, so that commit can apply it and rollback can undo it."""

    user_ids: tuple[int, ...]
    new_lengths: list[int]
    kept_pages: list[int]  # pages each user held before this prepare's new pages (onloaded ones included)
    created: list[bool]  # the resident entry was created for a user with nothing cached
    tags: list[bytes] | None  # applied at commit


class Transactions:
    """The prepares in flight over a `Residency` (not thread-safe)."""

    def __init__(self, residency: Residency, events: CacheEvents, counters: dict[str, int]) -> None:
        self._residency = residency
        self._events = events
        self._counters = counters
        self.pending: dict[int, PendingPrepare] = {}  # prepare id -> what it changed
        self._generations = itertools.count(FROM_HOST + 1)  # one per commit (kvcache.cache_version)

    def open(self, plan: PreparePlan, host_pages: dict[int, HostPages]) -> KVCacheMetadata:
        """Onload and allocate the planned batch from one allocation, and describe where its tokens live.

        A failure after the allocation (building the metadata) is undone before it propagates.
        """
        residency = self._residency
        layout, users, policy = residency.layout, residency.users, residency.policy
        fresh = residency.pool.alloc(plan.pages_needed)
        # Handed out in batch order, each user's onloaded pages then its new ones; the onloads of the
        # batch move together (on CUDA each layer of all of them before the next layer).
        onloads, new_pages, taken = [], [], 0
        for u, new in zip(plan.user_ids, plan.new_lengths):
            res, hp = users.get(u), host_pages.get(u)
            held = len(res.pages) if res is not None else 0
            cached = res.length if res is not None else hp.length if hp is not None else 0
            if hp is not None:
                held, live = layout.num_pages(hp.length), residency.release.live_pages(hp.length)
                onloads.append(Onload(u, hp, residency.release.onload_pages(hp.length, fresh[taken : taken + live])))
                taken += live
            extra = layout.num_pages(cached + new) - held  # the last partial page is filled first
            new_pages.append(fresh[taken : taken + extra])
            taken += extra
        try:
            residency.copy_onloads(onloads)
        except BaseException:  # e.g. out of memory for the staging buffer: nobody owns `fresh` yet
            residency.pool.free(fresh)
            raise
        onloaded = {move.user_id: move for move in onloads}
        kept, created, cached_start, cached_len, page_lists = [], [], [], [], []
        for u, start, extra in zip(plan.user_ids, plan.start_pos, new_pages):
            res = users.get(u)
            is_new = res is None and u not in onloaded
            if u in onloaded:
                res = residency.admit(onloaded[u])
            elif is_new:
                res = users[u] = Resident(start, 0, array("q"))
                policy.add(u)
            else:
                policy.touch(u)
            kept.append(len(res.pages))
            res.pages += extra
            created.append(is_new)
            cached_start.append(res.start_pos)
            cached_len.append(res.length)
            page_lists.append(res.pages)
        assert taken == len(fresh)
        prepare_id = next(_PREPARE_IDS)
        self.pending[prepare_id] = PendingPrepare(tuple(plan.user_ids), plan.new_lengths, kept, created, plan.tags)
        residency.in_flight.update(plan.user_ids)
        self._events.flush()  # onloads
        try:
            meta = build_metadata(
                prepare_id, plan.user_ids, cached_start, cached_len, plan.new_lengths, page_lists, layout.page_size
            )
        except BaseException:
            self.undo(self.pending.pop(prepare_id))
            raise
        hits = sum(1 for n in cached_len if n)
        self._counters["hits"] += hits
        self._counters["misses"] += len(cached_len) - hits
        self._counters["tokens_reused"] += sum(cached_len)
        return meta

    def take(self, meta: KVCacheMetadata) -> PendingPrepare:
        """The transaction `meta` describes, removed; refused when it is not pending here."""
        pending = self.pending.get(meta.prepare_id)
        if pending is None or pending.user_ids != meta.user_ids:
            raise KVCacheRequestError(
                "This metadata is stale: it was already committed or rolled back, or comes from another manager."
            )
        del self.pending[meta.prepare_id]
        return pending

    def commit(self, pending: PendingPrepare) -> None:
        """The new tokens (and tags) become cached; a user with nothing cached and nothing new is dropped."""
        residency = self._residency
        tags = pending.tags or itertools.repeat(None)
        for u, n, tag in zip(pending.user_ids, pending.new_lengths, tags):
            res = residency.users[u]
            res.length += n
            res.generation = next(self._generations)
            if tag is not None:
                res.tag = tag
            if res.length == 0:
                residency.drop(u)
            else:
                residency.release_unread(res, res.length - n)
                self._events.on_device(u, res.start_pos, res.length)
        self._events.flush()
        residency.in_flight.difference_update(pending.user_ids)
        self._counters["tokens_appended"] += sum(pending.new_lengths)
        residency.pool.mark_written()  # later offloads copy what this batch appended

    def undo(self, pending: PendingPrepare) -> None:
        """Free exactly the pages the prepare allocated for new tokens; onloaded data stays (it is valid)."""
        residency = self._residency
        freed = array("q")
        for u, kept, created in zip(pending.user_ids, pending.kept_pages, pending.created):
            res = residency.users[u]
            freed += res.pages[kept:]
            del res.pages[kept:]
            if created:
                residency.drop(u)
        residency.pool.free(freed)
        residency.in_flight.difference_update(pending.user_ids)
        self._counters["rollbacks"] += 1
