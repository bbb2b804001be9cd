"""KVCacheManager: the user-keyed paged KV cache (the API the model codes against).

The API and its lock live here. A prepare is planned and validated by `prepare_plan`, opened,
committed and rolled back by `Transactions`; which users the device holds and the moves between
device pages and the tiers live in `Residency`; pages come from `DevicePagePool`, victims from an
`EvictionPolicy`, and the host tier is any `HostKVStorage`. One RLock guards all of it.

A user is unknown, resident, host-only or in flight (`kvcache.residency` lists the states,
docs/kvcache.md draws the machine).

The host tier is the source of truth for what it holds (it may evict on its own, and a
persistent or shared tier may lose or change data behind the manager's back); the manager
never mirrors it, it asks `info`.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from .cache_version import CacheVersion, Residence
from .codecs import get_codec
from .config import KVCacheConfig
from .errors import KVCacheRequestError
from .events import CacheEventListener, CacheEvents
from .invariants import check_invariants
from .metadata import KVCacheMetadata
from .offload import OffloadWorker
from .policy import make_policy
from .pool import DevicePagePool
from .prepare_plan import plan_prepare, read_planned
from .residency import Residency
from .stats import CacheStats, new_counters, snapshot
from .storage import HostKVStorage, build_host_storage
from .transactions import Transactions
from .validation import UserIds, check_user_id, not_in_flight, user_id_list


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
        self._in_flight: set[int] = set()
        self._events = CacheEvents(event_listener)
        self._closed = False
        self._counters = new_counters()
        self._residency = Residency(
            self._layout, self._pool, host_storage, self._policy, self._events, self._counters, self._in_flight,
            stage_offloads=config.stages_offloads, read_window=config.read_window,
            compact_unread=get_codec(config.kv_codec).shrinks_zeros,
        )
        self._users = self._residency.users
        self._transactions = Transactions(self._residency, self._events, self._counters)
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
        layer `layer` of the onloads issued so far, and for no other layer: a forward asks for layer
        l's pages when it reaches layer l, so it computes the first layers while later ones copy."""
        self._pool.wait_for_layer(layer)
        return self._pool.k_cache(layer)

    def v_cache(self, layer: int) -> Tensor:
        """Layer `layer`'s V pages; waits like `k_cache`."""
        self._pool.wait_for_layer(layer)
        return self._pool.v_cache(layer)

    def times_cache(self) -> Tensor:
        """[num_pages + 1, page_size] int64: the time of the token in every slot (the caller's values,
        written with `paged_kvcache_ops.append_times`), moved with its page like K/V. On CUDA the
        current stream first waits (on the device) for layer 0 of the onloads issued so far, which
        carries their times."""
        self._pool.wait_for_layer(0)
        return self._pool.times_cache()

    def wait_for_onloads(self) -> None:
        """Make the current CUDA stream wait for every layer of the onloads issued so far (no host sync;
        no-op on CPU). A CUDA graph replay, which reads the pool without asking `k_cache`, needs it."""
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
            for u in self._refusing(user_id_list, user_ids):
                start, length, _ = self._residency.cached_entry(u)
                starts.append(start)
                lengths.append(length)
        return torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)

    def get_user_versions(self, user_ids: UserIds) -> list[CacheVersion]:
        """What each user's reusable tokens are now (range, tag, the generation of their commit): pass
        them as `prepare_kv_cache(..., expected_versions=)` to have the prepare refused if any changed
        meanwhile, also to other tokens of the same length (see `kvcache.cache_version`)."""
        with self._lock:
            self._check_open()
            return [self._residency.version(u) for u in self._refusing(user_id_list, user_ids)]

    def get_user_residences(self, user_ids: UserIds) -> list[Residence]:
        """`get_user_versions` with where each user's tokens are (device, this node's host tiers, a shared
        tier): one lookup per user that plans a visit and reports it (`kvcache.cache_version.Residence`)."""
        with self._lock:
            self._check_open()
            return [self._residency.residence(u) for u in self._refusing(user_id_list, user_ids)]

    def get_user_tags(self, user_ids: UserIds) -> list[bytes]:
        """The tag stored with each user's cached tokens (the one `get_user_kvdata_info` reports on);
        b"" when nothing is cached or the data was stored without a tag."""
        with self._lock:
            return [self._residency.cached_entry(u).tag for u in self._refusing(user_id_list, user_ids)]

    def read_kv(self, user_id: int, layer: int) -> tuple[Tensor, Tensor]:
        """The committed K and V of a user for one layer, [cached_len, H, D] each on the device (a copy).
        With a read window, tokens no later query reads hold unspecified values (kvcache/read_window.py)."""
        if not 0 <= layer < self.config.num_layers:
            raise IndexError(f"layer {layer} out of range for {self.config.num_layers} layers.")
        with self._lock:
            return self._residency.read_kv(self._refusing(check_user_id, user_id), layer)

    def read_times(self, user_id: int) -> Tensor:
        """The committed tokens' times of a user, [cached_len] int64 on the device (a copy); with a read
        window, unspecified for tokens no later query reads."""
        with self._lock:
            return self._residency.read_times(self._refusing(check_user_id, user_id))

    # ------------------------------------------------------------------ prepare / commit / rollback
    def prepare_kv_cache(
        self,
        user_ids: UserIds,
        start_pos: UserIds,
        new_lengths: UserIds,
        tags: Sequence[bytes] | None = None,
        *,
        expected_cached_lengths: UserIds | None = None,
        expected_versions: Sequence[CacheVersion] | None = None,
    ) -> KVCacheMetadata:
        """Validate a batch against the cache, onload and allocate pages, and return where its tokens live.

        Each user's input must continue its cached tokens exactly (a user with nothing cached
        may start anywhere). A refused batch raises a `KVCacheRequestError` and changes nothing.
        The new tokens become part of the cache only at `commit`, and so do `tags` (one per user,
        describing all the committed tokens; None keeps the users' tags): rollback keeps the old ones.

        `expected_cached_lengths` (one per user) is what the caller planned against, normally the
        lengths `get_user_kvdata_info` returned: a user whose cache no longer holds exactly that many
        tokens right before `start_pos` is refused with `KVCacheStaleError` (re-plan and retry). The
        guard is per caller: it holds whatever other callers asked or did in between. Lengths cannot
        see the tokens replaced by others of the same length; `expected_versions` (from
        `get_user_versions`) can, and is the guard for callers that share the cache across threads.
        """
        with self._lock:
            self._check_open()
            residency = self._residency
            plan = self._refusing(plan_prepare, residency, user_ids, start_pos, new_lengths, tags, expected_cached_lengths,
                                  expected_versions)
            if plan.pages_needed > self._pool.num_free:
                residency.evict_for(plan.pages_needed, batch=set(plan.user_ids), protect=plan.on_host.keys())
            host_pages = self._refusing(read_planned, residency, plan)
            return self._transactions.open(plan, host_pages)

    def commit(self, meta: KVCacheMetadata) -> None:
        """The forward succeeded: the batch's new tokens become cached."""
        with self._lock:
            self._transactions.commit(self._refusing(self._transactions.take, meta))

    def rollback(self, meta: KVCacheMetadata) -> None:
        """The forward failed: free the pages the prepare allocated; lengths are as before.

        Data onloaded from the host by that prepare stays on the device (it is valid).
        """
        with self._lock:
            self._transactions.undo(self._refusing(self._transactions.take, meta))

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
            onloaded = self._residency.prefetch(self._refusing(user_id_list, user_ids))
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
                users = [u for u in self._refusing(user_id_list, user_ids) if u in self._users]
            if self._worker is None:
                self._residency.offload_users(users)
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
                users = self._refusing(not_in_flight, user_ids, self._in_flight, "evicted")
            for u in users:
                if u in self._users:
                    self._residency.evict(u, offload=False)
            self._events.flush()

    def invalidate_kv_cache(self, user_ids: UserIds) -> None:
        """Forget the users' data in every tier (a restarted attention window, a rewritten history)."""
        with self._lock:
            self._check_open()
            users = self._refusing(not_in_flight, user_ids, self._in_flight, "invalidated")
            for u in users:
                self._residency.invalidate(u)
            self._events.flush()

    def stats(self) -> CacheStats:
        with self._lock:
            return snapshot(self._counters, self._pool, self._host, (self._residency.live_pages(r) for r in self._users.values()))

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
            check_invariants(self._residency)

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

    def _run_offload_job(self, user_ids: tuple[int, ...]) -> None:
        """Worker side of an async offload: one user per lock hold, skipping users already handled."""
        for u in user_ids:
            with self._lock:
                if u in self._offload_requested:
                    self._residency.offload(u)
                    self._events.flush()


