"""KVCacheManager: the user-keyed paged KV cache (the API the model codes against).

The API, pending prepares and their validation live here; which users the device holds and
the moves between device pages and the tiers live in `Residency`; pages come from
`DevicePagePool`, victims from an `EvictionPolicy`, and the host tier is any `HostKVStorage`.
One RLock guards all of it.

A user is, at any time, in one of these states (docs/kvcache.md draws the machine):

* unknown: nothing cached in any tier;
* resident: its committed tokens `[start_pos, start_pos + length)` are in device pages
  (`pages[i]` holds tokens `start_pos + i * page_size ...`), and the host may hold a prefix;
* host-only: evicted from the device, the host tier holds `(start_pos, length)`;
* in flight: resident, with a prepared but uncommitted batch; its extra pages are reserved
  and its length only moves at commit.

The host tier is the source of truth for what it holds (it may evict on its own, and a
persistent or shared tier may lose or change data behind the manager's back); the manager
never mirrors it, it asks `info`.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from . import paged_kvcache_ops
from .config import KVCacheConfig
from .errors import KVCacheCapacityError, KVCacheRequestError, KVCacheStaleError
from .events import CacheEventListener, CacheEvents
from .metadata import KVCacheMetadata, build_metadata, token_slots
from .offload import OffloadWorker
from .policy import make_policy
from .pool import DevicePagePool
from .residency import Residency, Resident
from .stats import CacheStats, new_counters, tier_counters
from .storage import HostEntry, HostKVStorage, HostPages, build_host_storage
from .validation import UserIds, check_continues, check_expected, check_range, int_list, tag_list

_PREPARE_IDS = itertools.count(1)  # process-wide, so a metadata object from another manager is refused too


@dataclass
class _Pending:
    """What a prepare changed, so that commit can apply it and rollback can undo it."""

    user_ids: tuple[int, ...]
    new_lengths: list[int]
    kept_pages: list[int]  # pages each user held before this prepare's new pages (onloaded ones included)
    created: list[bool]  # the resident entry was created for a user with nothing cached
    tags: list[bytes] | None  # applied at commit


@dataclass
class _Plan:
    """A validated prepare: nothing has been mutated yet."""

    user_ids: list[int]
    start_pos: list[int]
    new_lengths: list[int]
    on_host: dict[int, HostEntry]  # users to onload
    pages_needed: int
    tags: list[bytes] | None


class KVCacheManager:
    """User-keyed paged KV cache over a device page pool and a host tier. Thread-safe."""

    def __init__(
        self,
        config: KVCacheConfig,
        host_storage: HostKVStorage | None = None,
        event_listener: CacheEventListener | None = None,
    ) -> None:
        """`host_storage=None` builds the tiers the config names (and closes them in `close`): an
        in-memory tier, then a persistent and a Redis tier if configured (see `build_host_storage`).
        `event_listener` hears where this manager holds each user's K/V (see `kvcache.events`)."""
        self.config = config
        self._layout = config.page_layout
        self._pool = DevicePagePool(self._layout, config.num_pages, config.device)
        self._owns_host = host_storage is None
        if host_storage is None:
            host_storage = build_host_storage(config)
        try:
            host_storage.bind(self._layout)
        except BaseException:
            if self._owns_host:
                host_storage.close()
            raise
        self._host = host_storage
        self._policy = make_policy(config.eviction_policy)
        self._lock = threading.RLock()
        self._pending: dict[int, _Pending] = {}  # prepare id -> what it changed
        self._in_flight: set[int] = set()
        self._events = CacheEvents(event_listener)
        self._closed = False
        self._counters = new_counters()
        self._residency = Residency(
            self._layout, self._pool, host_storage, self._policy, self._events, self._counters, self._in_flight
        )
        self._users = self._residency.users
        self._offload_requested = self._residency.offload_requested
        self._worker: OffloadWorker | None = None
        if config.async_offload:
            self._worker = OffloadWorker(weakref.WeakMethod(self._run_offload_job))
            weakref.finalize(self, self._worker.close)

    @property
    def host_storage(self) -> HostKVStorage:
        """The host tier (a `TieredHostStorage` when several are configured: per-tier state in `.tiers`)."""
        return self._host

    # ------------------------------------------------------------------ device views
    @property
    def sink_slot(self) -> int:
        """A write-only slot outside every user's pages: where padding rows of a bucketed batch append."""
        return self._pool.sink_slot

    def k_cache(self, layer: int) -> Tensor:
        """[num_pages + 1, page_size, num_heads, head_dim], preallocated and never reallocated; the last
        page is the sink (see `sink_slot`). On CUDA the current stream first waits (on the device) for
        the onloads issued so far, so a forward reads onloaded pages only once they are there."""
        self._pool.wait_for_onloads()
        return self._pool.k_cache(layer)

    def v_cache(self, layer: int) -> Tensor:
        self._pool.wait_for_onloads()
        return self._pool.v_cache(layer)

    def wait_for_onloads(self) -> None:
        """Make the current CUDA stream wait for the onloads issued so far (no host sync; no-op on CPU).
        `k_cache`/`v_cache` do it; a CUDA graph replay, which reads the pool without asking, needs it."""
        self._pool.wait_for_onloads()

    # ------------------------------------------------------------------ lookups
    def get_user_kvdata_info(self, user_ids: UserIds) -> tuple[Tensor, Tensor]:
        """(cached_start_pos, cached_len), int64 [B] on CPU: what is reusable in any tier ((0, 0) if nothing).

        The answer may be out of date by the time the caller prepares (another caller may evict or
        invalidate in between): pass the lengths as `prepare_kv_cache(..., expected_cached_lengths=)`
        to have such a prepare refused instead of silently restarting the user's window.
        """
        starts, lengths = [], []
        with self._lock:
            self._check_open()
            for u in self._refusing(int_list, user_ids, "user_ids"):
                start, length, _ = self._residency.cached_entry(u)
                starts.append(start)
                lengths.append(length)
        return torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)

    def get_user_tags(self, user_ids: UserIds) -> list[bytes]:
        """The tag stored with each user's cached tokens (the one `get_user_kvdata_info` reports on);
        b"" when nothing is cached or the data was stored without a tag."""
        with self._lock:
            return [self._residency.cached_entry(u).tag for u in self._refusing(int_list, user_ids, "user_ids")]

    def read_kv(self, user_id: int, layer: int) -> tuple[Tensor, Tensor]:
        """The committed K and V of a user for one layer, [cached_len, H, D] each on the device (a copy)."""
        if not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.config.num_layers} layers.")
        lay = self._layout
        with self._lock:
            res = self._users.get(user_id)
            if res is not None and res.length:
                pages = np.asarray(res.pages, dtype=np.int64)
                slots = token_slots(pages, np.array([len(pages)]), np.array([0]), np.array([res.length]), lay.page_size)
                idx = torch.from_numpy(slots).to(self.config.device)
                return paged_kvcache_ops.gather_kvcache(self.k_cache(layer), self.v_cache(layer), idx)
            hp = self._host.read(user_id) if self._host.info(user_id) is not None else None
            if hp is None:
                empty = torch.zeros((0, lay.num_heads, lay.head_dim), dtype=lay.dtype, device=self.config.device)
                return empty, empty.clone()
            kv = hp.pages[:, layer].transpose(0, 1).reshape(2, -1, lay.num_heads, lay.head_dim)[:, : hp.length]
            kv = kv.to(self.config.device, copy=True)
            return kv[0], kv[1]

    # ------------------------------------------------------------------ prepare / commit / rollback
    def prepare_kv_cache(
        self,
        user_ids: UserIds,
        start_pos: UserIds,
        new_lengths: UserIds,
        tags: Sequence[bytes] | None = None,
        *,
        expected_cached_lengths: UserIds | None = None,
    ) -> KVCacheMetadata:
        """Validate a batch against the cache, onload and allocate pages, and return where its tokens live.

        Each user's input must continue its cached tokens exactly (a user with nothing cached
        may start anywhere). A refused batch raises a `KVCacheRequestError` and changes nothing.
        The new tokens become part of the cache only at `commit`, and so do `tags` (one per user,
        describing all the committed tokens; None keeps the users' tags): rollback keeps the old ones.

        `expected_cached_lengths` (one per user) is what the caller planned against, normally the
        lengths `get_user_kvdata_info` returned: a user whose cache no longer holds exactly that many
        tokens right before `start_pos` is refused with `KVCacheStaleError` (re-plan and retry). The
        guard is per caller: it holds whatever other callers asked or did in between.
        """
        with self._lock:
            self._check_open()
            plan = self._refusing(self._plan_prepare, user_ids, start_pos, new_lengths, tags, expected_cached_lengths)
            if plan.pages_needed > self._pool.num_free:
                self._residency.evict_for(plan.pages_needed, batch=set(plan.user_ids), protect=plan.on_host.keys())
            host_pages = self._refusing(self._read_host, plan)
            return self._execute(plan, host_pages)

    def commit(self, meta: KVCacheMetadata) -> None:
        """The forward succeeded: the batch's new tokens become cached."""
        with self._lock:
            pending = self._refusing(self._take_pending, meta)
            tags = pending.tags or itertools.repeat(None)
            for u, n, tag in zip(pending.user_ids, pending.new_lengths, tags):
                res = self._users[u]
                res.length += n
                if tag is not None:
                    res.tag = tag
                if res.length == 0:  # a visit with nothing new by a user with nothing cached
                    self._residency.drop(u)
                else:
                    self._events.on_device(u, res.start_pos, res.length)
            self._events.flush()
            self._in_flight.difference_update(pending.user_ids)
            self._counters["tokens_appended"] += sum(pending.new_lengths)
            self._pool.mark_written()

    def rollback(self, meta: KVCacheMetadata) -> None:
        """The forward failed: free the pages the prepare allocated; lengths are as before.

        Data onloaded from the host by that prepare stays on the device (it is valid).
        """
        with self._lock:
            pending = self._refusing(self._take_pending, meta)
            self._undo(pending)

    def _undo(self, pending: _Pending) -> None:
        freed = array("q")
        for u, kept, created in zip(pending.user_ids, pending.kept_pages, pending.created):
            res = self._users[u]
            freed += res.pages[kept:]
            del res.pages[kept:]
            if created:
                self._residency.drop(u)
        self._pool.free(freed)
        self._in_flight.difference_update(pending.user_ids)
        self._counters["rollbacks"] += 1

    # ------------------------------------------------------------------ tiers
    def prefetch(self, user_ids: UserIds) -> int:
        """Start onloading users that only a host tier holds into device pages; returns how many.

        For a caller that knows the next batch: the copies run on the onload stream while the current
        batch computes (on CPU they are done on return). Users unknown, already on the device or in
        flight are skipped, and so is a user whose pages cannot be made free without evicting another
        user of the same call or a user in flight, or whose tier cannot return what it reports. A
        prefetched user is resident with exactly the entry the tier held (start, length, tag), so
        `get_user_kvdata_info` answers the same before and after, and a plan made before stays valid.
        """
        with self._lock:
            self._check_open()
            users = list(dict.fromkeys(self._refusing(int_list, user_ids, "user_ids")))
            wanted: dict[int, HostEntry] = {}
            for u in users:
                if u not in self._users:
                    h = self._host.info(u)
                    if h is not None:
                        wanted[u] = h
            if not wanted:
                return 0
            onloaded = self._residency.prefetch(wanted)
            self._counters["prefetched_users"] += onloaded
            self._events.flush()
            return onloaded

    def offload_kv_cache(self, user_ids: UserIds | None = None) -> None:
        """Copy to the host tier what the device holds and the host lacks (None: every resident user).

        Incremental: only the rewritten last partial page and new pages move. Asynchronous when
        the config says so (`wait()` to block); committed tokens only.
        """
        with self._lock:
            self._check_open()
            if user_ids is None:
                users = list(self._users)
            else:
                users = [u for u in self._refusing(int_list, user_ids, "user_ids") if u in self._users]
            if self._worker is None:
                for u in users:
                    self._residency.offload(u)
                self._events.flush()
            else:
                self._offload_requested.update(users)
                self._worker.submit(tuple(users))

    def wait(self) -> None:
        """Block until every asynchronous offload requested so far has run."""
        if self._worker is not None:
            self._worker.wait()

    def evict_kv_cache(self, user_ids: UserIds | None = None) -> None:
        """Drop device data (None: every user not in flight); the host tier keeps what it has.

        A requested asynchronous offload of a user runs before its eviction.
        """
        with self._lock:
            self._check_open()
            if user_ids is None:
                users = [u for u in self._users if u not in self._in_flight]
            else:
                users = self._refusing(self._checked_users, user_ids, "evicted")
            for u in users:
                if u in self._users:
                    self._residency.evict(u, offload=False)
            self._events.flush()

    def invalidate_kv_cache(self, user_ids: UserIds) -> None:
        """Forget the users' data in every tier (a restarted attention window, a rewritten history)."""
        with self._lock:
            self._check_open()
            users = self._refusing(self._checked_users, user_ids, "invalidated")
            for u in users:
                if u in self._users:
                    self._residency.drop(u)
                self._host.drop(u)
                self._offload_requested.discard(u)
                self._events.gone(u)
            self._events.flush()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                **self._counters,
                **tier_counters(self._host.counters()),
                pages_in_use=self._pool.num_used,
                pages_total=self._pool.num_pages,
                users_on_device=len(self._users),
                users_on_host=self._host.num_users,
                host_bytes_used=self._host.bytes_used,
                host_capacity_bytes=self._host.capacity_bytes,
            )

    def close(self) -> None:
        """Finish pending offloads, stop the offload worker (async mode) and close the tiers the manager built.

        Idempotent. Every later call other than `close`, `wait` and `stats` is refused with a RuntimeError,
        so no offload can be queued behind the worker's stop (which would leave `wait` blocked forever).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._worker is not None:
                try:
                    self._worker.wait()
                finally:
                    self._worker.close()
        finally:
            if self._owns_host:
                with self._lock:
                    self._host.close()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (a debugging aid; O(pages))."""
        with self._lock:
            lay, pool = self._layout, self._pool
            owned = [p for res in self._users.values() for p in res.pages]
            free = pool.free_pages()
            assert len(owned) == len(set(owned)), "a page is owned twice"
            assert not set(owned) & set(free), "a page is both owned and free"
            assert len(owned) + len(free) == pool.num_pages == pool.num_used + pool.num_free, "pages leaked"
            assert len(self._policy) == len(self._users), "policy and residents disagree"
            assert self._in_flight <= self._users.keys(), "an in-flight user is not resident"
            for u, res in self._users.items():
                committed = lay.num_pages(res.length)
                if u in self._in_flight:
                    assert len(res.pages) >= committed, f"user {u} lost pages"
                else:
                    assert res.length > 0 and len(res.pages) == committed, f"user {u} holds wrong pages"
                h = self._host.info(u)
                assert h is None or (h.start_pos == res.start_pos and h.length <= res.length), f"user {u}: host ahead"

    # ------------------------------------------------------------------ internals (lock held)
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This KVCacheManager is closed.")

    def _refusing(self, fn, *args):
        """Call fn; count a refusal if it refuses."""
        try:
            return fn(*args)
        except KVCacheRequestError:
            self._counters["refusals"] += 1
            raise

    def _checked_users(self, user_ids: UserIds, verb: str) -> list[int]:
        users = int_list(user_ids, "user_ids")
        for u in users:
            if u in self._in_flight:
                raise KVCacheRequestError(f"User {u} has a prepare in flight and cannot be {verb}; commit or roll it back first.")
        return users

    def _plan_prepare(
        self,
        user_ids: UserIds,
        start_pos: UserIds,
        new_lengths: UserIds,
        tags: Sequence[bytes] | None,
        expected_cached_lengths: UserIds | None,
    ) -> _Plan:
        users = int_list(user_ids, "user_ids")
        starts = int_list(start_pos, "start_pos")
        news = int_list(new_lengths, "new_lengths")
        expected = None if expected_cached_lengths is None else int_list(expected_cached_lengths, "expected_cached_lengths")
        if not len(users) == len(starts) == len(news) == (len(users) if expected is None else len(expected)):
            named = f"{len(users)}, {len(starts)}, {len(news)}" + ("" if expected is None else f", {len(expected)}")
            raise KVCacheRequestError(f"user_ids, start_pos, new_lengths and expected_cached_lengths differ in length: {named}.")
        user_tags = None if tags is None else tag_list(tags, len(users))
        if len(set(users)) != len(users):
            seen: set[int] = set()
            dup = next(u for u in users if u in seen or seen.add(u))
            raise KVCacheRequestError(f"User {dup} appears more than once in the batch.")
        page_size = self._layout.page_size
        on_host: dict[int, HostEntry] = {}
        need = held = 0
        for b, (u, start, new) in enumerate(zip(users, starts, news)):
            check_range(u, start, new)
            if u in self._in_flight:
                raise KVCacheRequestError(f"User {u} has a prepare in flight; commit or roll it back first.")
            res = self._users.get(u)
            if res is not None:
                cached_start, cached_len, have = res.start_pos, res.length, len(res.pages)
                held += have
            else:
                h = self._host.info(u)
                cached_start, cached_len, have = (h.start_pos, h.length, 0) if h is not None else (start, 0, 0)
                if h is not None:
                    on_host[u] = h
            if expected is not None:
                check_expected(u, start, expected[b], cached_start, cached_len)
            if cached_len:
                check_continues(u, start, cached_start, cached_start + cached_len)
            need += -(-(cached_len + new) // page_size) - have
        in_flight = sum(len(self._users[u].pages) for u in self._in_flight)
        available = self._pool.num_pages - held - in_flight
        if need > available:
            raise KVCacheCapacityError(
                f"The batch needs {need} more pages but the pool can free at most {available} for it "
                f"(num_pages={self._pool.num_pages}; {held} held by the batch, {in_flight} by prepares in flight)."
            )
        return _Plan(users, starts, news, on_host, need, user_tags)

    def _read_host(self, plan: _Plan) -> dict[int, HostPages]:
        """Read what to onload.

        The in-memory tier keeps it (victims' offloads protected it). A persistent or shared tier
        may fail to return what `info` reported (a failure, a checksum, another node, a TTL): the
        batch continued data that is not there, so it is refused as stale (after the evictions),
        and an unreadable entry is dropped so that the next `get_user_kvdata_info` reports a miss.
        """
        out, failed = {}, []
        if plan.on_host:
            self._pool.sync_onloads()  # a read may promote into host memory an onload still reads
        for u, entry in plan.on_host.items():
            hp = self._host.read(u)
            if hp is None or hp.entry != entry:
                if hp is None:
                    self._host.drop(u)
                failed.append(f"user {u} up to position {entry.start_pos + entry.length - 1}")
            else:
                out[u] = hp
        if failed:  # all of them at once: one re-plan of the batch is enough
            raise KVCacheStaleError(
                f"The host tier could not return the cached tokens of {', '.join(failed)} (lost, unreadable or "
                "changed); call get_user_kvdata_info again and recompute from what is cached."
            )
        return out

    def _execute(self, plan: _Plan, host_pages: dict[int, HostPages]) -> KVCacheMetadata:
        page_size = self._layout.page_size
        users, policy = self._users, self._policy
        fresh = self._pool.alloc(plan.pages_needed)  # one allocation for the batch, handed out in order
        taken = 0
        kept, created, cached_start, cached_len, page_lists = [], [], [], [], []
        for u, start, new in zip(plan.user_ids, plan.start_pos, plan.new_lengths):
            res = users.get(u)
            is_new = res is None and u not in host_pages
            if res is not None:
                policy.touch(u)
            elif is_new:
                res = users[u] = Resident(start, 0, array("q"))
                policy.add(u)
            else:
                hp = host_pages[u]
                n = self._layout.num_pages(hp.length)
                res = self._residency.onload(u, hp, fresh[taken : taken + n])
                taken += n
            have = len(res.pages)
            extra = -(-(res.length + new) // page_size) - have
            if extra:
                res.pages += fresh[taken : taken + extra]
                taken += extra
            kept.append(have)
            created.append(is_new)
            cached_start.append(res.start_pos)
            cached_len.append(res.length)
            page_lists.append(res.pages)
        assert taken == len(fresh)
        prepare_id = next(_PREPARE_IDS)
        self._pending[prepare_id] = _Pending(tuple(plan.user_ids), plan.new_lengths, kept, created, plan.tags)
        self._in_flight.update(plan.user_ids)
        self._events.flush()  # onloads
        try:
            meta = build_metadata(
                prepare_id, plan.user_ids, cached_start, cached_len, plan.new_lengths, page_lists, page_size
            )
        except BaseException:
            self._undo(self._pending.pop(prepare_id))
            raise
        hits = sum(1 for n in cached_len if n)
        self._counters["hits"] += hits
        self._counters["misses"] += len(cached_len) - hits
        self._counters["tokens_reused"] += sum(cached_len)
        return meta

    def _take_pending(self, meta: KVCacheMetadata) -> _Pending:
        pending = self._pending.get(meta.prepare_id)
        if pending is None or pending.user_ids != meta.user_ids:
            raise KVCacheRequestError(
                "This metadata is stale: it was already committed or rolled back, or comes from another manager."
            )
        del self._pending[meta.prepare_id]
        return pending

    def _run_offload_job(self, user_ids: tuple[int, ...]) -> None:
        """Worker side of an async offload: one user per lock hold, skipping users already handled."""
        for u in user_ids:
            with self._lock:
                if u in self._offload_requested:
                    self._residency.offload(u)
                    self._events.flush()


