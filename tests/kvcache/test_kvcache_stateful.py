"""Random sequences of cache operations against a plain-dict reference model.

The reference knows, per user, the committed window `(start, length)` visible in some tier,
what the host tier holds, and who is resident on the device. It predicts every answer,
every refusal (with its exact message for gaps and overlaps) and the counters; the data
itself is checked token by token with `token_kv` (salted by an epoch bumped at each
invalidation, so stale data cannot pass for new).
"""
import dataclasses
import tempfile
from dataclasses import dataclass

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import (
    KVCacheCapacityError,
    KVCacheConfig,
    KVCacheManager,
    KVCacheRequestError,
    KVCacheStaleError,
    ReadWindow,
)
from kvcache.testing import append_batch, expected_kv, expected_times, new_token_kv, token_kv

USERS = st.integers(0, 5)
PAGE_SIZE, NUM_PAGES = 3, 8


def pages(n):
    return -(-n // PAGE_SIZE)


@dataclass
class Pending:
    meta: object
    users: list
    starts: list
    news: list
    cached: list  # committed (start, length) per user at prepare, after onload
    created: list
    pages: list  # pages each user holds while in flight


class CacheMachine(RuleBasedStateMachine):
    async_offload = False
    read_window = None
    kv_codec = "raw"

    def __init__(self):
        super().__init__()
        self.cfg = KVCacheConfig(
            num_layers=2, num_heads=1, head_dim=4, page_size=PAGE_SIZE, num_pages=NUM_PAGES,
            async_offload=self.async_offload, read_window=self.read_window, kv_codec=self.kv_codec,
        )
        self.mgr = KVCacheManager(self.cfg)
        self.data = {}  # user -> (start, length) visible in some tier, length > 0
        self.host = {}  # user -> (start, length) held by the host tier
        self.resident = set()
        self.reported = {}  # user -> (start, length) get_user_kvdata_info last answered: a caller's belief
        self.salt = {}
        self.pending = []
        self.finished = []
        self.counts = dict(hits=0, misses=0, tokens_reused=0, tokens_appended=0, rollbacks=0, refusals=0,
                           device_evictions=0)

    def teardown(self):
        self.mgr.close()

    # ------------------------------------------------------------ helpers
    def values(self, u, pos):
        return token_kv(self.cfg.page_layout, u, pos, self.salt.get(u, 0))

    def released(self, length):
        """Device pages a committed `length`-token user does not hold: those of unread tokens only."""
        if self.read_window is None:
            return 0
        first, stop = self.read_window.unread_pages(length, PAGE_SIZE)
        return max(stop - first, 0)

    def readable(self, length):
        """Token indices a later query reads (what the cache must give back exactly)."""
        if self.read_window is None:
            return slice(None)
        w = self.read_window
        return list(range(min(w.sink, length))) + list(range(w.unread_end(length), length))

    def in_flight(self):
        return {u: n for p in self.pending for u, n in zip(p.users, p.pages)}

    def refused(self, call, exc_type=KVCacheRequestError, message=None):
        try:
            call()
        except KVCacheRequestError as exc:
            assert type(exc) is exc_type, (type(exc), exc_type, exc)
            if message is not None:
                assert str(exc) == message
            self.counts["refusals"] += 1
            return
        raise AssertionError(f"expected {exc_type.__name__}")

    def drop_from_device(self, u):
        """Reference of an eviction: what remains visible is the host copy."""
        self.resident.discard(u)
        self.counts["device_evictions"] += 1
        if u in self.host:
            self.data[u] = self.host[u]
        else:
            self.data.pop(u, None)

    def expected_refusal(self, users, starts, news, expected):
        if len(set(users)) != len(users):
            return KVCacheRequestError, None
        flight = self.in_flight()
        need = held = 0
        for b, (u, s, n) in enumerate(zip(users, starts, news)):
            if u in flight:
                return KVCacheRequestError, None
            cs, cl = self.data.get(u, (s, 0))
            if expected is not None and not (cl == expected[b] and (cl == 0 or cs + cl == s)):
                return KVCacheStaleError, None
            if cl:
                end = cs + cl
                if s > end:
                    return KVCacheRequestError, (
                        f"User {u}: The input sequence has missing tokens from {end} to {s - 1} (both inclusive).")
                if s < cs:
                    return KVCacheRequestError, None
                if s < end:
                    return KVCacheRequestError, (
                        f"User {u}: The input sequence has overlapping tokens from {s} to {end - 1} (both inclusive).")
            have = pages(cl) if u in self.resident else 0
            held += have - self.released(cl) if u in self.resident else 0
            need += pages(cl + n) - have - (0 if u in self.resident else self.released(cl))
        if need > NUM_PAGES - held - sum(flight.values()):
            return KVCacheCapacityError, None
        return None

    # ------------------------------------------------------------ rules
    @precondition(lambda self: len(self.pending) < 3)
    @rule(data=st.data(), users=st.lists(USERS, min_size=1, max_size=3))
    def prepare(self, data, users):
        starts, news, beliefs = [], [], []
        for u in users:
            n = data.draw(st.integers(0, 8), label="new")
            kind = data.draw(st.sampled_from(["continue"] * 4 + ["gap", "overlap", "anywhere"]), label="kind")
            if u in self.data:
                cs, cl = self.data[u]
                end = cs + cl
                s = {"continue": end, "gap": end + data.draw(st.integers(1, 4)),
                     "overlap": end - data.draw(st.integers(1, cl + 2)), "anywhere": end}[kind]
            elif kind == "continue" and self.reported.get(u, (0, 0))[1]:
                s = sum(self.reported[u])  # planned against an answer that is no longer true
            else:
                s = data.draw(st.integers(0, 30), label="start")
            starts.append(max(s, 0))
            news.append(n)
            believed = self.reported.get(u, (0, 0))[1]
            beliefs.append(data.draw(st.sampled_from([self.data.get(u, (0, 0))[1], believed]), label="belief"))
        guarded = beliefs if data.draw(st.booleans(), label="guarded") else None
        expected = self.expected_refusal(users, starts, news, guarded)
        event(f"prepare -> {expected[0].__name__ if expected else 'ok'}")
        if expected is not None:
            self.refused(
                lambda: self.mgr.prepare_kv_cache(users, starts, news, expected_cached_lengths=guarded), *expected
            )
            return
        before = set(self.resident)
        meta = self.mgr.prepare_kv_cache(users, starts, news, expected_cached_lengths=guarded)
        for v in before - set(users) - set(self.mgr._users):  # evicted for room: offloaded first
            assert v not in self.in_flight()
            event("eviction for room")
            if v in self.data:
                self.host[v] = self.data[v]
            self.drop_from_device(v)
        cached, created, held = [], [], []
        for u, s, n in zip(users, starts, news):
            cs, cl = self.data.get(u, (s, 0))
            if cl and u not in self.resident:
                event("onload")
            cached.append((cs, cl))
            created.append(u not in self.data)
            held.append(pages(cl + n) - self.released(cl))
            self.resident.add(u)
            self.counts["hits" if cl else "misses"] += 1
            self.counts["tokens_reused"] += cl
        assert meta.cached_start_pos.tolist() == [c[0] for c in cached]
        assert meta.cached_lengths.tolist() == [c[1] for c in cached]
        assert meta.new_lengths.tolist() == news
        append_batch(self.mgr, meta, new_token_kv(self.cfg.page_layout, meta, starts, self.values))
        self.pending.append(Pending(meta, list(users), starts, news, cached, created, held))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit(self, data):
        p = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self.mgr.commit(p.meta)
        for u, (cs, cl), n in zip(p.users, p.cached, p.news):
            if cl + n:
                self.data[u] = (cs, cl + n)
            else:
                self.resident.discard(u)
        self.counts["tokens_appended"] += sum(p.news)
        self.finished.append(p.meta)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def rollback(self, data):
        p = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        garbage = -torch.ones(2, self.cfg.num_layers, sum(p.news), 1, 4)
        append_batch(self.mgr, p.meta, garbage)  # what a failing forward may have written
        self.mgr.rollback(p.meta)
        for u, is_new in zip(p.users, p.created):
            if is_new:
                self.resident.discard(u)
        self.counts["rollbacks"] += 1
        self.finished.append(p.meta)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), rollback=st.booleans())
    def finish_twice(self, data, rollback):
        meta = data.draw(st.sampled_from(self.finished))
        self.refused(lambda: (self.mgr.rollback if rollback else self.mgr.commit)(meta))

    @rule(users=st.none() | st.lists(USERS, max_size=3))
    def offload(self, users):
        self.mgr.offload_kv_cache(users)
        self.mgr.wait()
        for u in self.resident if users is None else set(users) & self.resident:
            if u in self.data:
                self.host[u] = self.data[u]

    @rule(users=st.none() | st.lists(USERS, max_size=3))
    def evict(self, users):
        flight = self.in_flight()
        if users is not None and set(users) & flight.keys():
            self.refused(lambda: self.mgr.evict_kv_cache(users))
            return
        self.mgr.evict_kv_cache(users)
        targets = self.resident if users is None else set(users) & self.resident
        for u in sorted(targets - flight.keys()):
            self.drop_from_device(u)

    @rule(users=st.lists(USERS, min_size=1, max_size=2))
    def invalidate(self, users):
        if set(users) & self.in_flight().keys():
            self.refused(lambda: self.mgr.invalidate_kv_cache(users))
            return
        self.mgr.invalidate_kv_cache(users)
        for u in set(users):
            self.data.pop(u, None)
            self.host.pop(u, None)
            self.resident.discard(u)
            self.salt[u] = self.salt.get(u, 0) + 1

    @rule(users=st.lists(USERS, min_size=1, max_size=3))
    def info(self, users):
        start, length = self.mgr.get_user_kvdata_info(users)
        expect = [self.data.get(u, (0, 0)) for u in users]
        assert list(zip(start.tolist(), length.tolist())) == expect
        self.reported.update(zip(users, expect))

    # ------------------------------------------------------------ invariants
    @invariant()
    def bookkeeping(self):
        self.mgr.check_invariants()
        assert set(self.mgr._users) == self.resident
        stats = self.mgr.stats()
        assert {k: getattr(stats, k) for k in self.counts} == self.counts
        assert stats.pages_in_use + self.mgr._pool.num_free == stats.pages_total == NUM_PAGES
        for u in range(6):
            h = self.mgr._host.info(u)
            assert (h if h is None else h[:2]) == self.host.get(u)

    @invariant()
    def data_matches(self):
        for u in range(6):
            start, length = self.data.get(u, (0, 0))
            read = self.readable(length)
            times = self.mgr.read_times(u)
            assert len(times) == length and torch.equal(times[read], expected_times(u, start, length)[read]), f"user {u} times"
            for layer in range(self.cfg.num_layers):
                k, v = self.mgr.read_kv(u, layer)
                ek, ev = expected_kv(self.cfg.page_layout, u, start, length, layer, self.salt.get(u, 0))
                assert len(k) == len(v) == length, f"user {u} layer {layer}"
                assert torch.equal(k[read], ek[read]) and torch.equal(v[read], ev[read]), f"user {u} layer {layer}"


class AsyncCacheMachine(CacheMachine):
    async_offload = True


_SETTINGS = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = _SETTINGS
TestAsyncCacheMachine = AsyncCacheMachine.TestCase
TestAsyncCacheMachine.settings = settings(_SETTINGS, max_examples=30)


class ReadWindowCacheMachine(CacheMachine):
    """A sliding-window model's cache: pages of unread tokens freed, offloaded as zeros (rewritten by the
    compressing codec); what later queries read stays exact, page accounting counts live pages."""

    read_window = ReadWindow(size=4, sink=1)
    kv_codec = "zstd-channel"  # rewrites the pages that went unread


TestReadWindowCacheMachine = ReadWindowCacheMachine.TestCase
TestReadWindowCacheMachine.settings = settings(_SETTINGS, max_examples=60)


# ---------------------------------------------------------------------- the stateful test, with a disk tier
class DiskTierCacheMachine(CacheMachine):
    """Same reference model: a chain whose lower tier never evicts behaves like one big host tier."""

    def __init__(self):
        super().__init__()
        self.mgr.close()
        self._dir = tempfile.TemporaryDirectory()
        self.cfg = dataclasses.replace(self.cfg, persistent_dir=self._dir.name)
        self.mgr = KVCacheManager(self.cfg)

    def teardown(self):
        super().teardown()
        self._dir.cleanup()


TestDiskTierCacheMachine = DiskTierCacheMachine.TestCase
TestDiskTierCacheMachine.settings = settings(
    max_examples=20, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
