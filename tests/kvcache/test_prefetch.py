"""Prefetch: onloading host-tier users ahead of their prepare, on every device; and the pinned slab."""
import threading

import numpy as np
import pytest
import torch

from helpers import assert_logits_close, build_processed, sensitive_model
from kvcache import KVCacheConfig, KVCacheManager, KVCacheStaleError
from kvcache.testing import expected_kv, serve

USERS = list(range(8))


def _manager(device="cpu", num_pages=40, **kw):
    cfg = KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, page_size=4, num_pages=num_pages, device=device,
                        host_capacity_bytes=1 << 20, **kw)
    return KVCacheManager(cfg)


def _history(mgr, users=USERS):
    """Every user served twice and offloaded, then evicted from the device: the host tier holds them all."""
    serve(mgr, users, [0] * len(users), [5 + u for u in users])
    mgr.offload_kv_cache()
    serve(mgr, users, [5 + u for u in users], [3] * len(users))
    mgr.offload_kv_cache()
    mgr.evict_kv_cache()


def _state(mgr, users=USERS):
    start, length = mgr.get_user_kvdata_info(users)
    kv = [mgr.read_kv(u, layer) for u in users for layer in range(mgr.config.num_layers)]
    return start.tolist(), length.tolist(), mgr.get_user_tags(users), kv


def _assert_holds_history(mgr, users=USERS):
    start, length = mgr.get_user_kvdata_info(users)
    for u, s, n in zip(users, start.tolist(), length.tolist()):
        for layer in range(mgr.config.num_layers):
            k, v = mgr.read_kv(u, layer)
            ek, ev = expected_kv(mgr.config.page_layout, u, s, n, layer)
            assert torch.equal(k.cpu(), ek) and torch.equal(v.cpu(), ev), u


def test_prefetch_then_serve_equals_serve_without_prefetch(device):
    plain, fetched = _manager(device), _manager(device)
    for mgr in (plain, fetched):
        _history(mgr)
    before = _state(fetched)
    assert fetched.prefetch(USERS[:5]) == 5
    assert _state(fetched)[:3] == before[:3]  # what a planner sees is unchanged
    assert fetched.stats().users_on_device == 5 and fetched.stats().prefetched_users == 5
    for mgr in (plain, fetched):
        start, length = mgr.get_user_kvdata_info(USERS)
        meta = serve(mgr, USERS, (start + length).tolist(), [3] * len(USERS))
        assert meta.cached_lengths.tolist() == length.tolist()
        mgr.check_invariants()
    a, b = plain.stats(), fetched.stats()
    assert (a.hits, a.tokens_reused, a.onloaded_bytes) == (b.hits, b.tokens_reused, b.onloaded_bytes)
    sa, sb = _state(plain), _state(fetched)
    assert sa[:3] == sb[:3]
    assert all(torch.equal(x, y) for pa, pb in zip(sa[3], sb[3]) for x, y in zip(pa, pb))
    _assert_holds_history(fetched)


def test_prefetch_of_unknown_resident_or_in_flight_users_is_a_no_op():
    mgr = _manager()
    _history(mgr, [1, 2])
    serve(mgr, [3], [0], [4])  # resident
    meta = mgr.prepare_kv_cache([1], [mgr.get_user_kvdata_info([1])[1].item()], [2])  # in flight (onloaded)
    before = (_state(mgr, [1, 2, 3, 99])[:3], mgr.stats().pages_in_use, mgr.stats().users_on_device)
    assert mgr.prefetch([99, 3, 1]) == 0
    assert (_state(mgr, [1, 2, 3, 99])[:3], mgr.stats().pages_in_use, mgr.stats().users_on_device) == before
    mgr.commit(meta)
    assert mgr.prefetch([2, 2]) == 1 and mgr.prefetch([2]) == 0  # duplicates once; then resident
    mgr.check_invariants()


def test_prefetch_never_evicts_users_in_flight_and_skips_what_does_not_fit():
    mgr = _manager(num_pages=12)
    _history(mgr, [1, 2, 3])  # 3 users of 9-11 tokens: 3 pages each
    meta = mgr.prepare_kv_cache([1], [9], [2])
    assert mgr.prefetch([2, 3, 4]) == 2  # 3 + 3 + 3 pages fit beside user 1's
    mgr.commit(meta)
    mgr.evict_kv_cache([2, 3])
    meta = mgr.prepare_kv_cache([1], [11], [20])  # user 1 holds 8 of the 12 pages while in flight
    assert mgr.prefetch([2, 3]) == 1  # room for one only: the other is skipped, user 1 untouched
    mgr.commit(meta)
    mgr.check_invariants()
    _assert_holds_history(mgr, [2, 3])


def test_prefetch_racing_evict_and_invalidate_never_serves_stale_data():
    """A planner that read the cache before a prefetch and an eviction/invalidation either continues
    exactly what it planned against or is refused as stale; never a silent restart."""
    mgr = _manager(num_pages=36)
    _history(mgr)
    errors, stop = [], threading.Event()

    def churn():
        rng = np.random.default_rng(0)
        while not stop.is_set():
            users = rng.choice(USERS, 3, replace=False).tolist()
            try:
                mgr.prefetch(users)
                mgr.evict_kv_cache([users[0]])
                if rng.random() < 0.2:
                    mgr.invalidate_kv_cache([users[1]])
            except Exception as exc:  # in flight: refused, nothing changed
                if "in flight" not in str(exc):
                    errors.append(exc)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for step in range(150):
            u = USERS[step % len(USERS)]
            start, length = (int(x) for x in mgr.get_user_kvdata_info([u]))
            end = start + length if length else 0
            try:
                meta = mgr.prepare_kv_cache([u], [end], [2], expected_cached_lengths=[length])
            except KVCacheStaleError:
                continue
            except Exception as exc:
                if "in flight" in str(exc):
                    continue
                raise
            assert meta.cached_lengths.tolist() == [length]
            mgr.rollback(meta)
    finally:
        stop.set()
        thread.join(10)
    assert not errors and not thread.is_alive()
    mgr.check_invariants()
    _assert_holds_history(mgr)


def test_close_with_prefetches_running_returns():
    mgr = _manager(async_offload=True)
    _history(mgr)
    done = threading.Event()

    def prefetching():
        try:
            while True:
                mgr.prefetch(USERS)
                mgr.evict_kv_cache()
                mgr.offload_kv_cache()
        except RuntimeError:  # closed
            done.set()

    thread = threading.Thread(target=prefetching, daemon=True)
    thread.start()
    mgr.close()
    thread.join(30)
    assert done.is_set() and not thread.is_alive()
    mgr.close()
    mgr.wait()


def test_serving_allocates_no_host_memory_for_pages_after_warm_up():
    """Offload and onload reuse the memory tier's slab (pinned on CUDA): one allocation, ever."""
    mgr = _manager()
    slab = mgr.host_storage.slab
    assert slab.allocations == 1
    for visit in range(6):
        _history(mgr) if visit == 0 else None
        users = USERS[visit % 2 :: 2]
        mgr.prefetch(users)
        start, length = mgr.get_user_kvdata_info(users)
        serve(mgr, users, (start + length).tolist(), [3] * len(users))
        mgr.offload_kv_cache()
        mgr.evict_kv_cache()
    assert slab.allocations == 1 and mgr.host_storage.slab is slab
    assert slab.pinned == (mgr.config.device.type == "cuda")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from data.dataset import InferenceDataset
    from model.config import config_for_dataset

    dataset = InferenceDataset(build_processed(tmp_path_factory.mktemp("prefetch")))
    model = sensitive_model(config_for_dataset("tiny", dataset), 0)
    return dataset, model


def test_the_session_prefetching_the_next_batch_serves_the_same_logits(world, device):
    from model.cache_config import kv_cache_config
    from model.inference import InferenceSession

    dataset, model = world
    model = model.to(device)
    cfg = model.config
    batches = list(dataset.batches(dataset.request_indices(max_requests=48), 4))
    runs = []
    for prefetch in (False, True):
        cache = KVCacheManager(kv_cache_config(cfg, num_pages=600, host_capacity_bytes=1 << 24, device=device))
        session = InferenceSession(model, dataset, kv_cache=cache)
        results = []
        for i, idx in enumerate(batches):
            after = batches[i + 1] if prefetch and i + 1 < len(batches) else None
            results.append(session.serve(idx, next_request_indices=after))
            cache.evict_kv_cache(results[-1].user_ids.tolist())  # returning users come back from the host tier
        assert cache.host_storage.slab.allocations == 1  # offloads and onloads reused the slab
        runs.append((results, cache.stats()))
    (plain, plain_stats), (fetched, fetched_stats) = runs
    for a, b in zip(plain, fetched):
        assert_logits_close(a.logits, b.logits)
        assert a.tokens_reused == b.tokens_reused
    assert fetched_stats.prefetched_users > 0 and plain_stats.prefetched_users == 0
    assert (plain_stats.hits, plain_stats.onloaded_bytes) == (fetched_stats.hits, fetched_stats.onloaded_bytes)
