"""The cache under pressure, under concurrent callers, and with asynchronous offload."""
import dataclasses
import random
import threading
import time

import pytest
import torch

from kvcache import KVCacheConfig, KVCacheManager, KVCacheStaleError
from kvcache.testing import expected_kv, expected_times, serve

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 4, 4


def _config(**kw):
    base = dict(num_layers=LAYERS, num_heads=HEADS, head_dim=HEAD_DIM, page_size=PAGE, num_pages=16)
    base.update(kw)
    return KVCacheConfig(**base)


def _check_user(mgr, user, expect_end, window_start=0):
    """What is reported lies in the user's current window [window_start, expect_end) and its data is right."""
    start, length = (t.item() for t in mgr.get_user_kvdata_info([user]))
    if length:
        assert window_start <= start and start + length <= expect_end
        assert torch.equal(mgr.read_times(user), expected_times(user, start, length)), f"stale times for user {user}"
        for layer in range(LAYERS):
            k, v = mgr.read_kv(user, layer)
            ek, ev = expected_kv(mgr.config.page_layout, user, start, length, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev), f"stale data for user {user}"
    return start, length


MAX_WINDOW = 40  # tokens; a longer history restarts its window (bounds the pages a batch needs)


def _visit(mgr, rng, users, hist):
    """One visit of `users`, continuing what the cache reports, as the model does.

    `hist[u] = (window_start, end)`: u's history ends at `end`, and the cache should hold
    `[window_start, end)`. A user with nothing cached, or a window too long, restarts at `end`.
    Returns what get_user_kvdata_info reported.
    """
    start, length = mgr.get_user_kvdata_info(users)
    starts = []
    for u, s, n in zip(users, start.tolist(), length.tolist()):
        end = hist.get(u, (0, 0))[1]
        if n >= MAX_WINDOW:
            mgr.invalidate_kv_cache([u])
            n = 0
        if not n:
            hist[u] = (end, end)
        starts.append(s + n if n else end)
    news = [rng.randint(0, 5) for _ in users]
    serve(mgr, users, starts, news)
    for u, s, n in zip(users, starts, news):
        hist[u] = (hist[u][0] if u in hist else s, s + n)
    return list(zip(start.tolist(), length.tolist()))


def _replay(mgr, num_users, visits, seed, batch=3, offload_every=4):
    rng = random.Random(seed)
    hist = {}
    for step in range(visits):
        _visit(mgr, rng, rng.sample(range(num_users), batch), hist)
        if step % offload_every == 0:
            mgr.offload_kv_cache()
        if step % 5 == 0:
            mgr.wait()
            mgr.check_invariants()
            for u, (window_start, end) in hist.items():
                _check_user(mgr, u, end, window_start)
    mgr.wait()
    return hist


def _cached(window_start, end):
    return (window_start, end - window_start) if end > window_start else (0, 0)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_small_pool_large_host_never_loses_data(policy):
    mgr = KVCacheManager(_config(num_pages=40, eviction_policy=policy))
    rng = random.Random(0)
    hist = {}
    for _ in range(200):
        users = rng.sample(range(30), 3)
        expected = [_cached(*hist.get(u, (0, 0))) for u in users]
        assert _visit(mgr, rng, users, hist) == expected  # everything is still cached somewhere
    for u, (window_start, end) in hist.items():
        assert _check_user(mgr, u, end, window_start) == _cached(window_start, end)
    stats = mgr.stats()
    assert stats.device_evictions > 20 and stats.onloaded_bytes > 0 and stats.host_evictions == 0
    mgr.check_invariants()


@pytest.mark.parametrize("stage_offloads", [False, True], ids=["one_by_one", "staged"])
def test_small_host_loses_only_whole_users_and_returns_nothing_stale(stage_offloads):
    """Staged: a user's write may evict the host entry a later user of the same offload was planned on."""
    page_nbytes = _config().page_layout.page_nbytes
    mgr = KVCacheManager(_config(num_pages=40, host_capacity_bytes=20 * page_nbytes, stage_offloads=stage_offloads))
    hist = _replay(mgr, num_users=30, visits=200, seed=1)
    stats = mgr.stats()
    assert stats.host_evictions > 0 and stats.host_bytes_used <= 20 * page_nbytes
    for u, (window_start, end) in hist.items():
        _check_user(mgr, u, end, window_start)


def test_stale_plans_are_refused_under_pressure():
    page_nbytes = _config().page_layout.page_nbytes
    mgr = KVCacheManager(_config(num_pages=4, host_capacity_bytes=2 * page_nbytes))
    serve(mgr, [1], [0], [12])  # 3 pages
    start, length = mgr.get_user_kvdata_info([1])  # another caller plans user 1's next visit...
    serve(mgr, [2], [0], [16])  # ...meanwhile user 1 is evicted and the 2-page host cannot keep it
    assert mgr.stats().host_rejected_writes == 1
    with pytest.raises(KVCacheStaleError):
        mgr.prepare_kv_cache([1], [int(start + length)], [1], expected_cached_lengths=length)
    assert mgr.get_user_kvdata_info([1])[1].item() == 0  # asking again tells the truth
    serve(mgr, [1], [12], [1])


def _serve_disjoint(mgr, users, seconds, seed, errors):
    try:
        rng = random.Random(seed)
        ends = {u: 0 for u in users}
        window = {u: 0 for u in users}  # where each user's cached window starts

        def expected(u):
            return (window[u], ends[u] - window[u]) if ends[u] > window[u] else (0, 0)

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batch = rng.sample(users, 2)
            start, length = mgr.get_user_kvdata_info(batch)
            assert list(zip(start.tolist(), length.tolist())) == [expected(u) for u in batch]
            for u in batch:
                if ends[u] - window[u] >= MAX_WINDOW:
                    mgr.invalidate_kv_cache([u])
                    window[u] = ends[u]
            news = [rng.randint(1, 9) for _ in batch]
            starts = [ends[u] for u in batch]
            if rng.random() < 0.2:  # a failing forward
                meta = mgr.prepare_kv_cache(batch, starts, news)
                mgr.rollback(meta)
                continue
            serve(mgr, batch, starts, news)
            for u, s, n in zip(batch, starts, news):
                ends[u] = s + n
            if rng.random() < 0.3:
                mgr.offload_kv_cache(batch)
            if rng.random() < 0.1:
                mgr.offload_kv_cache(batch)
                mgr.evict_kv_cache(batch)
        for u in users:
            assert _check_user(mgr, u, ends[u], window[u]) == expected(u)
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


@pytest.mark.parametrize("async_offload", [False, True])
def test_threads_serving_disjoint_users(async_offload):
    # 4 threads x 2 users x at most 13 pages in flight fit; the 40 users (~400 pages) do not
    mgr = KVCacheManager(_config(num_pages=112, async_offload=async_offload))
    errors = []
    threads = [
        threading.Thread(target=_serve_disjoint, args=(mgr, list(range(t * 10, t * 10 + 10)), 1.5, t, errors))
        for t in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mgr.wait()
    assert not errors, errors[0]
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.device_evictions > 0 and stats.rollbacks > 0 and stats.refusals == 0
    mgr.close()


def test_async_offload_matches_sync():
    results = []
    for async_offload in (False, True):
        mgr = KVCacheManager(_config(num_pages=40, async_offload=async_offload))
        hist = _replay(mgr, num_users=16, visits=80, seed=2, offload_every=2)
        mgr.offload_kv_cache()
        mgr.evict_kv_cache([0, 1, 2])  # an eviction right after an async offload request waits for it
        mgr.wait()
        stats = mgr.stats()
        data = {
            u: [mgr.read_kv(u, layer) for layer in range(LAYERS)] + [mgr.get_user_kvdata_info([u])]
            for u in hist
        }
        results.append((stats, data))
        mgr.close()
    (stats_sync, data_sync), (stats_async, data_async) = results
    # An async offload copies the state of the moment it runs, so how many bytes moved may differ.
    timing = dict(offloaded_bytes=0, host_bytes_used=0)
    assert dataclasses.replace(stats_sync, **timing) == dataclasses.replace(stats_async, **timing)
    for u in data_sync:
        for a, b in zip(data_sync[u], data_async[u]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_staged_offloads_match_one_user_at_a_time(monkeypatch):
    """Offloads staged together (one gather and copy for the users of a call or of an eviction, as on
    CUDA) leave every tier and counter as offloading one user at a time does."""
    from kvcache.pool import DevicePagePool

    copies = []
    copy_out = DevicePagePool.copy_out
    monkeypatch.setattr(DevicePagePool, "copy_out", lambda self, pages, dst: copies.append(len(pages)) or
                        copy_out(self, pages, dst))
    results = []
    for staged in (False, True):
        copies.clear()
        mgr = KVCacheManager(_config(num_pages=40, stage_offloads=staged))
        assert (mgr._residency.staging is not None) == staged
        hist = _replay(mgr, num_users=16, visits=80, seed=3, offload_every=2)
        mgr.offload_kv_cache()
        mgr.evict_kv_cache()
        data = {u: [t for layer in range(LAYERS) for t in mgr.read_kv(u, layer)] + [mgr.read_times(u)] for u in hist}
        results.append((mgr.stats(), data, list(copies)))
        mgr.close()
    (stats_one, data_one, copies_one), (stats_staged, data_staged, copies_staged) = results
    assert stats_one == stats_staged and stats_one.device_evictions > 0
    for u in data_one:
        assert all(torch.equal(a, b) for a, b in zip(data_one[u], data_staged[u]))
    assert sum(copies_one) == sum(copies_staged)  # the same pages left the device
    assert len(copies_staged) < len(copies_one) / 2  # in far fewer copies


def test_stage_offloads_defaults_to_cuda_and_is_checked():
    assert not _config().stages_offloads and _config(stage_offloads=True).stages_offloads
    with pytest.raises(ValueError, match="stage_offloads"):
        _config(stage_offloads="yes")


def test_async_worker_does_not_keep_the_manager_alive():
    import gc
    import weakref

    mgr = KVCacheManager(_config(async_offload=True))
    serve(mgr, [1], [0], [3])
    mgr.offload_kv_cache()
    mgr.wait()
    worker_thread = mgr._worker._thread
    ref = weakref.ref(mgr)
    del mgr
    gc.collect()
    assert ref() is None
    worker_thread.join(timeout=5)
    assert not worker_thread.is_alive()
