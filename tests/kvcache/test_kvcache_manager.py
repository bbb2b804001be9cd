"""KVCacheManager semantics: round trips, prepare/commit/rollback, refusals, tiers, counters."""
import contextlib
import dataclasses
import random
import threading

import pytest
import torch

from kvcache import (
    HostEntry,
    HostKVStorage,
    InMemoryHostStorage,
    KVCacheCapacityError,
    KVCacheConfig,
    KVCacheManager,
    KVCacheRequestError,
    KVCacheStaleError,
)
from kvcache.testing import append_batch, expected_kv, expected_times, new_token_kv, serve, token_kv


def _config(**kw):
    base = dict(num_layers=2, num_heads=2, head_dim=4, page_size=4, num_pages=16)
    base.update(kw)
    return KVCacheConfig(**base)


def _info(mgr, users):
    start, length = mgr.get_user_kvdata_info(users)
    return list(zip(start.tolist(), length.tolist()))


def _assert_holds(mgr, user, start, length, salt=0):
    assert _info(mgr, [user]) == [(start if length else 0, length)]
    assert torch.equal(mgr.read_times(user).cpu(), expected_times(user, start, length)), f"user {user} times"
    for layer in range(mgr.config.num_layers):
        k, v = mgr.read_kv(user, layer)
        ek, ev = expected_kv(mgr.config.page_layout, user, start, length, layer, salt)
        assert torch.equal(k, ek.to(k.device)) and torch.equal(v, ev.to(v.device)), f"user {user} layer {layer}"


def _snapshot(mgr, users):
    stats = dataclasses.replace(mgr.stats(), refusals=0)
    data = {u: [mgr.read_kv(u, layer) for layer in range(mgr.config.num_layers)] for u in users}
    return stats, _info(mgr, users), data


def _assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    for u in a[2]:
        for (ka, va), (kb, vb) in zip(a[2][u], b[2][u]):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(page_size=2.0), "page_size must be a positive int"),
        (dict(dtype=torch.int32), "dtype must be a floating"),
        (dict(device="nonsense"), "device is not a device"),
        (dict(host_capacity_bytes=-1), "host_capacity_bytes must be an int >= 0"),
        (dict(eviction_policy="fifo"), "eviction_policy must be one of"),
        (dict(async_offload="yes"), "async_offload must be a bool"),
    ],
)
def test_config_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


def test_config_is_frozen_and_derives_layout():
    cfg = _config()
    assert cfg.device == torch.device("cpu") and cfg.page_layout.page_shape == (2, 2, 4, 2, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 8
    mgr = KVCacheManager(cfg)
    assert mgr.k_cache(1).shape == (16 + 1, 4, 2, 4) and mgr.k_cache(1).is_contiguous()  # + the sink page
    assert mgr.k_cache(0).data_ptr() != mgr.v_cache(0).data_ptr()


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_round_trip_across_pages_evictions_and_reloads(page_size, device):
    mgr = KVCacheManager(_config(page_size=page_size, num_pages=4096 // page_size, device=device))
    visits = [(1, 0, 5), (2, 7, 40), (1, 5, 30), (3, 0, 1), (2, 47, 33), (1, 35, 1), (3, 1, 64)]
    expect = {}
    for i, (u, start, n) in enumerate(visits):
        serve(mgr, [u], [start], [n])
        first = expect.get(u, (start, 0))[0]
        expect[u] = (first, start + n - first)
        for w, (s, length) in expect.items():
            _assert_holds(mgr, w, s, length)
        if i % 2:
            mgr.offload_kv_cache()
            mgr.evict_kv_cache()
            assert mgr.stats().pages_in_use == 0
            for w, (s, length) in expect.items():  # served from the host tier
                _assert_holds(mgr, w, s, length)
    mgr.check_invariants()


def test_round_trip_bf16_random_values():
    cfg = _config(dtype=torch.bfloat16, page_size=8, num_pages=64)
    mgr = KVCacheManager(cfg)
    g = torch.Generator().manual_seed(3)
    written = {u: [] for u in (1, 2)}

    def values(u, pos):
        kv = torch.randn(2, cfg.num_layers, len(pos), cfg.num_heads, cfg.head_dim, generator=g).to(cfg.dtype)
        written[u].append(kv)
        return kv

    serve(mgr, [1, 2], [0, 0], [11, 3], values)
    mgr.offload_kv_cache([1])
    serve(mgr, [1, 2], [11, 3], [6, 20], values)
    mgr.offload_kv_cache()
    mgr.evict_kv_cache([1, 2])
    serve(mgr, [2], [23], [1], values)  # reloads 2; 1 stays on the host
    for u in (1, 2):
        full = torch.cat(written[u], dim=2)
        for layer in range(cfg.num_layers):
            k, v = mgr.read_kv(u, layer)
            assert torch.equal(k, full[0, layer]) and torch.equal(v, full[1, layer])


def test_metadata_layout():
    mgr = KVCacheManager(_config())
    serve(mgr, [1], [0], [6])
    meta = mgr.prepare_kv_cache([2, 1, 3], [10, 6, 4], [3, 5, 0])
    assert meta.user_ids == (2, 1, 3)
    assert meta.cached_start_pos.tolist() == [10, 0, 4] and meta.cached_lengths.tolist() == [0, 6, 0]
    assert meta.new_lengths.tolist() == [3, 5, 0] and meta.total_lengths.tolist() == [3, 11, 0]
    assert meta.kv_offsets.tolist() == [0, 3, 14, 14] and meta.new_offsets.tolist() == [0, 3, 8, 8]
    assert meta.page_indptr.tolist() == [0, 1, 4, 4] and meta.last_page_lens.tolist() == [3, 3, 0]
    assert meta.page_indices.dtype == meta.page_indptr.dtype == meta.last_page_lens.dtype == torch.int32
    pages = meta.page_indices.tolist()
    expected = []
    for b, total in enumerate(meta.total_lengths.tolist()):
        own = pages[meta.page_indptr[b] : meta.page_indptr[b + 1]]
        expected += [own[t // 4] * 4 + t % 4 for t in range(total)]
    assert meta.kv_slots.tolist() == expected
    assert meta.new_token_slots.tolist() == expected[:3] + expected[3 + 6 : 14]
    mgr.rollback(meta)


# ---------------------------------------------------------------- commit / rollback
def test_new_tokens_count_only_after_commit():
    mgr = KVCacheManager(_config())
    serve(mgr, [1], [0], [6])
    meta = mgr.prepare_kv_cache([1], [6], [5])
    append_batch(mgr, meta, new_token_kv(mgr.config.page_layout, meta, [6], lambda u, p: token_kv(mgr.config.page_layout, u, p)))
    _assert_holds(mgr, 1, 0, 6)
    mgr.commit(meta)
    _assert_holds(mgr, 1, 0, 11)
    assert mgr.stats().tokens_appended == 11


def test_rollback_restores_the_previous_state_exactly():
    mgr = KVCacheManager(_config())
    serve(mgr, [1, 2], [0, 0], [6, 3])
    pages_before = {u: list(mgr._users[u].pages) for u in (1, 2)}
    free_before = sorted(mgr._pool.free_pages())
    meta = mgr.prepare_kv_cache([1, 2, 3], [6, 3, 9], [7, 1, 5])
    garbage = torch.full((2, 2, 13, 2, 4), -7.0)
    append_batch(mgr, meta, garbage)  # the failed forward wrote into the tail of existing pages too
    mgr.rollback(meta)
    assert {u: list(mgr._users[u].pages) for u in (1, 2)} == pages_before and 3 not in mgr._users
    assert sorted(mgr._pool.free_pages()) == free_before
    _assert_holds(mgr, 1, 0, 6)
    _assert_holds(mgr, 2, 0, 3)
    assert _info(mgr, [3]) == [(0, 0)]
    serve(mgr, [1, 3], [6, 2], [2, 2])  # the tail slots are simply rewritten
    _assert_holds(mgr, 1, 0, 8)
    _assert_holds(mgr, 3, 2, 2)
    assert mgr.stats().rollbacks == 1
    mgr.check_invariants()


def test_rollback_keeps_onloaded_data():
    mgr = KVCacheManager(_config())
    serve(mgr, [1], [0], [6])
    mgr.offload_kv_cache()
    mgr.evict_kv_cache()
    meta = mgr.prepare_kv_cache([1], [6], [3])
    mgr.rollback(meta)
    assert 1 in mgr._users and mgr._users[1].length == 6
    _assert_holds(mgr, 1, 0, 6)
    mgr.check_invariants()


def test_stale_metadata_is_refused():
    mgr = KVCacheManager(_config())
    meta = serve(mgr, [1], [0], [3])
    with pytest.raises(KVCacheRequestError, match="stale"):
        mgr.commit(meta)
    with pytest.raises(KVCacheRequestError, match="stale"):
        mgr.rollback(meta)
    other = KVCacheManager(_config())
    foreign = other.prepare_kv_cache([5], [0], [1])
    with pytest.raises(KVCacheRequestError, match="stale"):
        mgr.commit(foreign)
    other.commit(foreign)
    assert mgr.stats().refusals == 3 and mgr.stats().tokens_appended == 3


def test_zero_length_visits_and_start_anywhere():
    mgr = KVCacheManager(_config())
    meta = serve(mgr, [1, 2], [0, 100], [0, 5])
    assert meta.cached_start_pos.tolist() == [0, 100]
    assert _info(mgr, [1, 2]) == [(0, 0), (100, 5)]
    assert 1 not in mgr._users
    meta = serve(mgr, [2], [105], [0])
    assert meta.kv_slots.numel() == 5 and meta.new_token_slots.numel() == 0
    _assert_holds(mgr, 2, 100, 5)
    assert mgr.stats().hits == 1 and mgr.stats().misses == 2


# ---------------------------------------------------------------- refusals
def _refusal_cases(mgr):
    """(callable, exception type, exact message or None) on a cache where 1 holds [0, 10) and 2 is in flight."""
    return [
        (lambda: mgr.prepare_kv_cache([1], [20], [3]), KVCacheRequestError,
         "User 1: The input sequence has missing tokens from 10 to 19 (both inclusive)."),
        (lambda: mgr.prepare_kv_cache([1], [5], [8]), KVCacheRequestError,
         "User 1: The input sequence has overlapping tokens from 5 to 9 (both inclusive)."),
        (lambda: mgr.prepare_kv_cache([4, 1], [0, 11], [2, 3]), KVCacheRequestError,
         "User 1: The input sequence has missing tokens from 10 to 10 (both inclusive)."),
        (lambda: mgr.prepare_kv_cache([3, 3], [0, 0], [1, 1]), KVCacheRequestError, None),
        (lambda: mgr.prepare_kv_cache([3], [-1], [1]), KVCacheRequestError, None),
        (lambda: mgr.prepare_kv_cache([3], [0], [-1]), KVCacheRequestError, None),
        (lambda: mgr.prepare_kv_cache([3], [0, 1], [1]), KVCacheRequestError, None),
        (lambda: mgr.prepare_kv_cache([3.5], [0], [1]), KVCacheRequestError, None),
        (lambda: mgr.prepare_kv_cache([2], [2], [1]), KVCacheRequestError, None),
        (lambda: mgr.prepare_kv_cache([3, 1], [0, 10], [200, 1]), KVCacheCapacityError, None),
        (lambda: mgr.evict_kv_cache([2]), KVCacheRequestError, None),
        (lambda: mgr.invalidate_kv_cache([1, 2]), KVCacheRequestError, None),
    ]


def test_every_refusal_changes_nothing():
    mgr = KVCacheManager(_config(num_pages=12))
    serve(mgr, [1, 5], [0, 0], [10, 4])
    mgr.offload_kv_cache([5])
    meta = mgr.prepare_kv_cache([2], [0], [2])  # 2 stays in flight
    users = [1, 2, 3, 4, 5]
    cases = _refusal_cases(mgr)
    for call, exc_type, message in cases:
        before = _snapshot(mgr, users)
        refusals = mgr.stats().refusals
        with pytest.raises(exc_type) as info:
            call()
        if message is not None:
            assert str(info.value) == message
        assert isinstance(info.value, ValueError)
        _assert_same(before, _snapshot(mgr, users))
        assert mgr.stats().refusals == refusals + 1
        mgr.check_invariants()
    mgr.commit(meta)
    assert mgr.stats().refusals == len(cases)


def test_batch_needing_more_pages_than_the_pool_is_refused_but_fits_after_eviction():
    mgr = KVCacheManager(_config(num_pages=8))
    serve(mgr, [1, 2], [0, 0], [12, 12])  # 3 + 3 pages
    with pytest.raises(KVCacheCapacityError):
        mgr.prepare_kv_cache([1, 3], [12, 0], [4, 20])  # needs 1 + 5, only 2 free + 3 of user 2
    serve(mgr, [1, 3], [12, 0], [4, 12])  # needs 1 + 3: evicts user 2 (offloaded first)
    assert 2 not in mgr._users and mgr.stats().device_evictions == 1
    _assert_holds(mgr, 2, 0, 12)


def test_users_in_flight_are_not_evicted_and_their_pages_are_not_available():
    mgr = KVCacheManager(_config(num_pages=8))
    pending = mgr.prepare_kv_cache([1], [0], [16])  # 4 pages in flight
    with pytest.raises(KVCacheCapacityError):
        mgr.prepare_kv_cache([2], [0], [20])
    serve(mgr, [2], [0], [16])
    mgr.evict_kv_cache()  # everything but the user in flight
    assert list(mgr._users) == [1]
    mgr.commit(pending)


# ---------------------------------------------------------------- eviction policy and tiers
@pytest.mark.parametrize("policy, victim", [("lru", 1), ("lfu", 2)])
def test_eviction_follows_the_policy(policy, victim):
    mgr = KVCacheManager(_config(num_pages=3, eviction_policy=policy))
    serve(mgr, [1, 2, 3], [0, 0, 0], [4, 4, 4])
    for u in (1, 1, 2, 3):  # visits: 1 three times, 2 and 3 twice; recency 1 < 2 < 3
        serve(mgr, [u], [4], [0])
    serve(mgr, [9], [0], [4])  # LRU evicts 1 (least recent); LFU evicts 2 (least visits, then least recent)
    assert victim not in mgr._users and len(mgr._users) == 3
    _assert_holds(mgr, victim, 0, 4)  # offloaded before eviction


def test_offload_is_incremental_and_host_matches_device():
    cfg = _config()
    mgr = KVCacheManager(cfg)
    page = cfg.page_layout.page_nbytes
    serve(mgr, [1], [0], [6])
    mgr.offload_kv_cache()
    assert mgr.stats().offloaded_bytes == 2 * page
    mgr.offload_kv_cache()
    assert mgr.stats().offloaded_bytes == 2 * page  # nothing new
    serve(mgr, [1], [6], [7])  # 13 tokens: page 1 rewritten, pages 2 and 3 new
    mgr.offload_kv_cache([1])
    assert mgr.stats().offloaded_bytes == 5 * page
    assert mgr._host.info(1) == HostEntry(0, 13)
    mgr.evict_kv_cache()
    _assert_holds(mgr, 1, 0, 13)
    serve(mgr, [1], [13], [1])
    assert mgr.stats().onloaded_bytes == 4 * page


def test_invalidate_drops_every_tier():
    mgr = KVCacheManager(_config())
    serve(mgr, [1, 2], [0, 0], [6, 6])
    mgr.offload_kv_cache()
    mgr.evict_kv_cache([2])
    mgr.invalidate_kv_cache([1, 2, 99])
    assert _info(mgr, [1, 2]) == [(0, 0), (0, 0)]
    assert mgr.stats().users_on_host == 0 and mgr.stats().pages_in_use == 0
    serve(mgr, [1], [40], [3], lambda u, p: token_kv(mgr.config.page_layout, u, p, salt=1))
    _assert_holds(mgr, 1, 40, 3, salt=1)


def test_prepare_planned_against_evicted_data_is_refused_and_changes_nothing():
    mgr = KVCacheManager(_config())
    serve(mgr, [1], [0], [6])
    start, length = mgr.get_user_kvdata_info([1])
    assert (int(start[0]), int(length[0])) == (0, 6)
    mgr.evict_kv_cache([1])  # never offloaded: gone (e.g. another thread's admin call)
    before = mgr.stats()
    with pytest.raises(KVCacheStaleError, match="User 1: the cache holds nothing, but the batch was planned against 6 tokens"):
        mgr.prepare_kv_cache([1], [6], [2], expected_cached_lengths=length)  # planned with the old answer
    assert mgr.stats().pages_in_use == before.pages_in_use == 0
    mgr.check_invariants()
    serve(mgr, [1], [6], [2])  # planned against "nothing cached": starting at 6 is a deliberate restart
    _assert_holds(mgr, 1, 6, 2)


def test_the_stale_guard_holds_per_caller_when_another_caller_asks_in_between():
    mgr = KVCacheManager(_config())
    serve(mgr, [7], [0], [10])
    _, length_a = mgr.get_user_kvdata_info([7])  # caller A plans 2 new tokens after 10 cached
    mgr.evict_kv_cache([7])
    mgr.get_user_kvdata_info([7])  # caller B asks: nothing cached (this acknowledges nothing for A)
    with pytest.raises(KVCacheStaleError):
        mgr.prepare_kv_cache([7], [10], [2], expected_cached_lengths=length_a)
    assert _info(mgr, [7]) == [(0, 0)]


def test_the_stale_guard_holds_under_hammering_threads():
    """8 threads serve disjoint visits of shared users while evictions run: a window may restart only at 0."""
    mgr = KVCacheManager(_config(num_pages=64))
    users = list(range(12))
    locks = {u: threading.Lock() for u in users}  # one visit of a user at a time, as a session batches them
    errors, restarted = [], []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(150):
                u = rng.choice(users)
                if rng.random() < 0.2:
                    with contextlib.suppress(KVCacheRequestError):
                        mgr.evict_kv_cache([u])
                    continue
                with locks[u]:
                    start, length = mgr.get_user_kvdata_info([u])
                    s, n = int(start[0]), int(length[0])
                    end = s + n if n else 0  # nothing cached: recompute from the first token
                    try:
                        meta = mgr.prepare_kv_cache([u], [end], [rng.randint(1, 3)], expected_cached_lengths=[n])
                    except KVCacheStaleError:
                        continue
                    mgr.commit(meta)
                    if mgr.get_user_kvdata_info([u])[0].item() != 0:
                        restarted.append(u)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not restarted, f"windows restarted after position 0: {sorted(set(restarted))}"
    mgr.check_invariants()


def test_a_position_overflow_is_refused_before_anything_changes():
    mgr = KVCacheManager(KVCacheConfig(2, 2, 8, page_size=4, num_pages=16))
    before = mgr.stats()
    with pytest.raises(KVCacheRequestError, match=r"User 500: tokens .* reach past the largest token position"):
        mgr.prepare_kv_cache([500], [2**63], [1])
    with pytest.raises(KVCacheRequestError, match="User 500"):
        mgr.prepare_kv_cache([500], [2**31 - 1], [1])
    assert mgr.stats().pages_in_use == before.pages_in_use == 0
    serve(mgr, [500], [0], [3])  # the user is not stuck "in flight"
    mgr.evict_kv_cache([500])
    mgr.invalidate_kv_cache([500])
    mgr.check_invariants()


def test_a_failure_after_allocation_rolls_the_prepare_back(monkeypatch):
    import kvcache.transactions as transactions_module

    mgr = KVCacheManager(_config())
    serve(mgr, [1], [0], [5])

    def broken(*args, **kwargs):
        raise MemoryError("no memory for the page tables")

    monkeypatch.setattr(transactions_module, "build_metadata", broken)
    with pytest.raises(MemoryError):
        mgr.prepare_kv_cache([1, 2], [5, 0], [3, 3])
    monkeypatch.undo()
    mgr.check_invariants()
    assert _info(mgr, [1, 2]) == [(0, 5), (0, 0)]
    serve(mgr, [1, 2], [5, 0], [3, 3])  # neither user is left in flight
    _assert_holds(mgr, 1, 0, 8)


def test_host_eviction_of_a_device_evicted_user_is_visible_and_nothing_stale():
    cfg = _config(host_capacity_bytes=_config().page_layout.page_nbytes * 3)
    mgr = KVCacheManager(cfg)
    serve(mgr, [1, 2], [0, 0], [8, 8])
    mgr.offload_kv_cache([1])
    mgr.evict_kv_cache([1])
    _assert_holds(mgr, 1, 0, 8)
    mgr.offload_kv_cache([2])  # the host (3 pages) drops user 1 to store user 2
    assert _info(mgr, [1]) == [(0, 0)]
    assert mgr.read_kv(1, 0)[0].shape == (0, 2, 4)
    stats = mgr.stats()
    assert stats.host_evictions == 1 and stats.users_on_host == 1
    serve(mgr, [2], [8], [8])
    mgr.offload_kv_cache([2])  # 4 pages do not fit in a 3-page tier: not stored
    assert mgr.stats().host_rejected_writes == 1 and mgr._host.info(2) == HostEntry(0, 8)


def test_victims_offload_never_pushes_out_the_data_being_onloaded():
    page = _config().page_layout.page_nbytes
    mgr = KVCacheManager(_config(num_pages=3, host_capacity_bytes=3 * page))
    serve(mgr, [1], [0], [8])
    mgr.offload_kv_cache()
    mgr.evict_kv_cache()  # the host holds user 1 (2 pages)
    serve(mgr, [2], [0], [12])  # the pool (3 pages) is full of user 2
    meta = mgr.prepare_kv_cache([1], [8], [0])  # onloads 1: evicts 2, whose 3 pages do not fit beside 1
    mgr.commit(meta)
    _assert_holds(mgr, 1, 0, 8)
    assert mgr.stats().host_rejected_writes == 1 and _info(mgr, [2]) == [(0, 0)]


def test_custom_host_storage_plugs_in():
    calls = []

    class Recording(InMemoryHostStorage):
        def write(self, user_id, start_pos, length, first_page, fill, protect=(), tag=b""):
            calls.append((user_id, start_pos, length, first_page))
            return super().write(user_id, start_pos, length, first_page, fill, protect, tag)

    assert issubclass(Recording, HostKVStorage)
    mgr = KVCacheManager(_config(), host_storage=Recording(1 << 20))
    serve(mgr, [1], [3], [6])
    mgr.offload_kv_cache()
    serve(mgr, [1], [9], [3])
    mgr.offload_kv_cache()
    assert calls == [(1, 3, 6, 0), (1, 3, 9, 1)]


def test_stats_snapshot_is_frozen_and_complete():
    mgr = KVCacheManager(_config())
    serve(mgr, [1], [0], [5])
    serve(mgr, [1, 2], [5, 0], [2, 1])
    s = mgr.stats()
    assert (s.hits, s.misses, s.tokens_reused, s.tokens_appended) == (1, 2, 5, 8)
    assert (s.pages_in_use, s.pages_owned, s.pages_total, s.users_on_device, s.users_on_host) == (3, 3, 16, 2, 0)
    assert s.hit_rate == pytest.approx(1 / 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.hits = 0
    assert set(s.as_dict()) >= {
        "hits", "misses", "tokens_reused", "tokens_appended", "onloaded_bytes", "offloaded_bytes",
        "device_evictions", "host_evictions", "pages_in_use", "pages_total", "refusals",
        "users_on_device", "users_on_host", "rollbacks",
    }


def test_stats_show_a_page_in_use_that_no_user_owns():
    """What a soak reads from /metrics at its end to tell a leaked page from a long window."""
    mgr = KVCacheManager(_config())
    serve(mgr, [1, 2], [0, 0], [5, 1])
    mgr._pool.alloc(1)  # taken and never given to a user: a leak
    s = mgr.stats()
    assert (s.pages_in_use, s.pages_owned) == (4, 3)


def test_user_ids_may_be_tensors():
    mgr = KVCacheManager(_config())
    serve(mgr, torch.tensor([4, 5]), torch.tensor([0, 2]), torch.tensor([3, 3]))
    assert _info(mgr, torch.tensor([5, 4])) == [(2, 3), (0, 3)]


def _serve_and_offload_until_closed(mgr, seed, errors):
    rng = random.Random(seed)
    try:
        for i in range(40):
            u = seed * 100 + i % 3
            _, length = mgr.get_user_kvdata_info([u])
            mgr.commit(mgr.prepare_kv_cache([u], [int(length[0])], [rng.randint(1, 3)]))
            mgr.offload_kv_cache([u])
    except RuntimeError as exc:  # the manager was closed under this thread
        if "closed" not in str(exc):
            errors.append(exc)
    except Exception as exc:  # pragma: no cover - reported below
        errors.append(exc)


def test_close_racing_async_offloads_never_hangs():
    """Threads prepare/commit/offload while another closes: every call returns, later ones are refused."""
    for run in range(7):
        mgr = KVCacheManager(_config(num_pages=64, async_offload=True))
        errors = []
        threads = [threading.Thread(target=_serve_and_offload_until_closed, args=(mgr, i, errors)) for i in range(4)]
        for t in threads:
            t.start()
        closer = threading.Thread(target=mgr.close)
        closer.start()
        for t in [*threads, closer]:
            t.join(timeout=30)
            assert not t.is_alive(), f"run {run}: a call hung"
        waiter = threading.Thread(target=lambda m=mgr: (m.wait(), m.close()))
        waiter.start()
        waiter.join(timeout=10)
        assert not waiter.is_alive(), f"run {run}: wait() or a second close() hung after close"
        assert not errors, errors
        with pytest.raises(RuntimeError, match="closed"):
            mgr.offload_kv_cache([1])


def test_events_report_where_each_user_is_held():
    from kvcache import CacheEvent, CacheLocation

    heard = []
    page = _config().page_layout.page_nbytes
    mgr = KVCacheManager(_config(num_pages=8, host_capacity_bytes=4 * page), event_listener=heard.extend)
    serve(mgr, [1, 2], [0, 0], [6, 5])
    assert heard == [CacheEvent(1, CacheLocation.DEVICE, 0, 6), CacheEvent(2, CacheLocation.DEVICE, 0, 5)]
    heard.clear()
    mgr.offload_kv_cache([1])
    mgr.evict_kv_cache([1, 2])  # 1 survives in the host tier, 2 was never offloaded
    assert heard == [CacheEvent(1, CacheLocation.HOST, 0, 6), CacheEvent(2, CacheLocation.NONE, 0, 0)]
    heard.clear()
    serve(mgr, [1], [6], [1])  # onloaded, then committed
    assert heard == [CacheEvent(1, CacheLocation.DEVICE, 0, 6), CacheEvent(1, CacheLocation.DEVICE, 0, 7)]
    heard.clear()
    mgr.invalidate_kv_cache([1])
    assert heard == [CacheEvent(1, CacheLocation.NONE, 0, 0)]


def test_a_failing_event_listener_does_not_break_the_cache():
    def broken(events):
        raise RuntimeError("index unreachable")

    mgr = KVCacheManager(_config(), event_listener=broken)
    serve(mgr, [1], [0], [4])
    _assert_holds(mgr, 1, 0, 4)


def test_a_failed_onload_leaks_no_device_pages(monkeypatch):
    """An onload copy that fails (e.g. out of memory for its staging buffer) refuses the prepare or
    the prefetch and gives back every page it took: the pool and the bookkeeping are as before."""
    from kvcache.residency import Residency

    mgr = KVCacheManager(_config(num_pages=16))
    serve(mgr, [1, 2], [0, 0], [6, 5])
    mgr.offload_kv_cache([1, 2])
    mgr.evict_kv_cache([1, 2])
    free_before = mgr.stats().pages_total - mgr.stats().pages_in_use

    def failing_copy(self, moves):
        raise MemoryError("no room for the staging buffer")

    monkeypatch.setattr(Residency, "copy_onloads", failing_copy)
    with pytest.raises(MemoryError):
        mgr.prepare_kv_cache([1], [6], [2])
    with pytest.raises(MemoryError):
        mgr.prefetch([2])
    stats = mgr.stats()
    assert stats.pages_total - stats.pages_in_use == free_before and stats.users_on_device == 0
    mgr.check_invariants()
    monkeypatch.undo()
    serve(mgr, [1], [6], [2])  # the cache still serves the user, from its host entry
    assert [int(x) for x in mgr.get_user_kvdata_info([1])[1]] == [8]
