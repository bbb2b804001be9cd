"""KVCacheManager's boundary: what a caller planned against is checked by version, not length, and
user ids and their dtypes are checked before anything changes (issue 21)."""
from __future__ import annotations

import pytest
import torch

from kvcache import CacheVersion, InMemoryHostStorage, KVCacheConfig, KVCacheManager, KVCacheRequestError, KVCacheStaleError
from kvcache.testing import serve, token_kv

CFG = KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, page_size=4, num_pages=16)


def _state(mgr: KVCacheManager, users: list[int]) -> tuple:
    start, length = mgr.get_user_kvdata_info(users)
    stats = mgr.stats()
    return start.tolist(), length.tolist(), mgr.get_user_versions(users), stats.pages_in_use, stats.tokens_appended


def test_tokens_rewritten_to_the_same_length_fail_the_version_guard_not_the_length_guard():
    mgr = KVCacheManager(CFG)
    serve(mgr, [7], [0], [8])
    planned = mgr.get_user_versions([7])  # caller A plans 2 tokens after these 8
    _, length = mgr.get_user_kvdata_info([7])
    # caller B restarts user 7 with other tokens of the same length
    mgr.invalidate_kv_cache([7])
    serve(mgr, [7], [0], [8], lambda u, p: token_kv(CFG.page_layout, u, p, salt=5))
    assert mgr.get_user_kvdata_info([7])[1].tolist() == length.tolist()  # lengths cannot tell
    before = _state(mgr, [7])
    with pytest.raises(KVCacheStaleError, match=r"User 7: the cached tokens changed .* same range and tag"):
        mgr.prepare_kv_cache([7], [8], [2], expected_versions=planned)
    assert _state(mgr, [7]) == before
    mgr.check_invariants()
    meta = mgr.prepare_kv_cache([7], [8], [2], expected_versions=mgr.get_user_versions([7]))  # re-planned
    mgr.rollback(meta)


def test_a_version_survives_a_round_trip_through_the_host_tier_and_changes_with_a_commit():
    mgr = KVCacheManager(CFG, host_storage=InMemoryHostStorage(1 << 20))
    mgr.commit(mgr.prepare_kv_cache([3], [0], [6], tags=[b"t"]))  # what the tokens hold does not matter here
    (committed,) = mgr.get_user_versions([3])
    assert committed[:3] == (0, 6, b"t") and committed.generation > 0
    mgr.offload_kv_cache([3])
    mgr.evict_kv_cache([3])
    (on_host,) = mgr.get_user_versions([3])
    assert on_host == CacheVersion(0, 6, b"t", 0)  # named by its host entry alone
    assert mgr.prefetch([3]) == 1 and mgr.get_user_versions([3]) == [on_host]  # a plan made before holds
    meta = mgr.prepare_kv_cache([3], [6], [1], expected_versions=[on_host])
    mgr.commit(meta)
    assert mgr.get_user_versions([3])[0].generation > committed.generation
    assert mgr.get_user_versions([99]) == [CacheVersion(0, 0, b"", 0)]


BAD_USER_IDS = [
    ([2**64], "2\\*\\*63"),
    ([-1], "user id -1 is not an integer in \\[0, 2\\*\\*63\\)"),
    ([True], "bool"),
    (torch.tensor([True]), "torch.bool"),
    (torch.tensor([1.0]), "torch.float32"),
    ([1.5], "ints"),
]


@pytest.mark.parametrize("users, message", BAD_USER_IDS)
def test_bad_user_ids_are_refused_by_every_call_and_change_nothing(users, message):
    mgr = KVCacheManager(CFG, host_storage=InMemoryHostStorage(1 << 20))
    serve(mgr, [1], [0], [5])  # user 1: what True would have silently become
    before = _state(mgr, [1])
    calls = {
        "get_user_kvdata_info": lambda: mgr.get_user_kvdata_info(users),
        "get_user_versions": lambda: mgr.get_user_versions(users),
        "get_user_tags": lambda: mgr.get_user_tags(users),
        "prepare_kv_cache": lambda: mgr.prepare_kv_cache(users, [5], [1]),
        "offload_kv_cache": lambda: mgr.offload_kv_cache(users),
        "evict_kv_cache": lambda: mgr.evict_kv_cache(users),
        "invalidate_kv_cache": lambda: mgr.invalidate_kv_cache(users),
        "prefetch": lambda: mgr.prefetch(users),
    }
    for name, call in calls.items():
        with pytest.raises(KVCacheRequestError, match=message):
            call()
        assert _state(mgr, [1]) == before, name
    for one in (2**64, -1, True):
        with pytest.raises(KVCacheRequestError, match="is not an integer in"):
            mgr.read_kv(one, 0)
        with pytest.raises(KVCacheRequestError, match="is not an integer in"):
            mgr.read_times(one)
    mgr.check_invariants()


class _SharedMemory(InMemoryHostStorage):
    """A host tier every manager of the test sees (what Redis is to nodes)."""

    shared = True


def test_one_residence_lookup_says_what_is_reusable_and_where():
    shared = _SharedMemory(1 << 20)
    a, b = KVCacheManager(CFG, host_storage=shared), KVCacheManager(CFG, host_storage=shared)
    serve(a, [5], [0], [6])
    a.offload_kv_cache([5])
    (on_a,) = a.get_user_residences([5])
    assert on_a.version == a.get_user_versions([5])[0] and on_a.on_device
    assert on_a.best_host == (0, 6) and on_a.own_host is None  # a shared tier is nobody's own
    (on_b,) = b.get_user_residences([5])  # the other node sees the shared copy only
    assert not on_b.on_device and on_b.own_host is None and on_b.best_host == (0, 6)
    assert on_b.version == CacheVersion(0, 6, b"", 0)
    own = KVCacheManager(CFG, host_storage=InMemoryHostStorage(1 << 20))
    serve(own, [9], [0], [5])
    own.offload_kv_cache([9])
    own.evict_kv_cache([9])
    (evicted,) = own.get_user_residences([9])
    assert not evicted.on_device and evicted.own_host == evicted.best_host == (0, 5)
    assert own.get_user_residences([1]) == [(CacheVersion(0, 0, b"", 0), False, None, None)]
