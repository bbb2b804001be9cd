"""The tag that travels with a user's K/V, the tier chain (TieredHostStorage), the tier settings of
KVCacheConfig."""
import pytest
import torch

from helpers import TINY_LAYOUT_ARGS, host_pages, pages_equal
from kvcache import (
    DiskHostStorage,
    FailOpenStorage,
    HostEntry,
    InMemoryHostStorage,
    KVCacheConfig,
    KVCacheManager,
    KVCacheRequestError,
    PageLayout,
    TieredHostStorage,
    build_host_storage,
)
from kvcache.page_data import concat_pages
from kvcache.testing import append_batch, expected_kv, new_token_kv, serve, token_kv

LAYOUT = PageLayout(**TINY_LAYOUT_ARGS)
PAGE = LAYOUT.page_nbytes


def _pages(n, value):
    return host_pages(LAYOUT, n, value)


def _fill(pages):
    return lambda dst: dst.copy_(pages)


class Recording(InMemoryHostStorage):
    """An in-memory tier that records the pages each write asks for."""

    def __init__(self, capacity_bytes):
        super().__init__(capacity_bytes)
        self.writes = []

    def write(self, user_id, start_pos, length, first_page, fill, protect=(), tag=b""):
        self.writes.append((user_id, first_page, self.layout.num_pages(length)))
        return super().write(user_id, start_pos, length, first_page, fill, protect, tag)


def _chain(*capacity_pages):
    tiers = [Recording(c * PAGE) for c in capacity_pages]
    chain = TieredHostStorage(tiers)
    chain.bind(LAYOUT)
    return chain, tiers


def _config(**kw):
    return KVCacheConfig(**{**dict(num_layers=2, num_heads=1, head_dim=2, page_size=4, num_pages=16), **kw})


def _serve_tagged(mgr, users, starts, news, tags):
    layout = mgr.config.page_layout
    meta = mgr.prepare_kv_cache(users, starts, news, tags=tags)
    append_batch(mgr, meta, new_token_kv(layout, meta, starts, lambda u, p: token_kv(layout, u, p)))
    mgr.commit(meta)
    return meta


# ---------------------------------------------------------------------- the tag
def test_tags_apply_at_commit_travel_to_the_host_and_back_and_are_cleared_by_invalidate():
    mgr = KVCacheManager(_config())
    _serve_tagged(mgr, [1, 2], [0, 0], [5, 3], [b"a1", b"b1"])
    assert mgr.get_user_tags([1, 2, 3]) == [b"a1", b"b1", b""]
    meta = mgr.prepare_kv_cache([1], [5], [2], tags=[b"a2"])
    assert mgr.get_user_tags([1]) == [b"a1"]  # not before commit
    mgr.rollback(meta)
    assert mgr.get_user_tags([1]) == [b"a1"]  # rollback keeps the old tag
    _serve_tagged(mgr, [1], [5], [2], [b"a2"])
    serve(mgr, [1], [7], [1])  # tags=None keeps the tag
    assert mgr.get_user_tags([1]) == [b"a2"]
    mgr.offload_kv_cache()
    assert mgr.host_storage.info(1) == HostEntry(0, 8, b"a2")
    _serve_tagged(mgr, [1], [8], [0], [b"a3"])  # a new tag without new tokens is offloaded too
    mgr.offload_kv_cache([1])
    assert mgr.host_storage.info(1).tag == b"a3"
    mgr.evict_kv_cache()
    assert mgr.get_user_tags([1, 2]) == [b"a3", b"b1"]  # from the host tier
    mgr.commit(mgr.prepare_kv_cache([1], [8], [0]))  # onload restores it on the device
    assert mgr._users[1].tag == b"a3" and mgr.get_user_tags([1]) == [b"a3"]
    mgr.invalidate_kv_cache([1, 2])
    assert mgr.get_user_tags([1, 2]) == [b"", b""]


@pytest.mark.parametrize("tags", [[b"x"], [b"x", "y"], b"xy", [b"x", None]])
def test_malformed_tags_are_refused_and_change_nothing(tags):
    mgr = KVCacheManager(_config())
    with pytest.raises(KVCacheRequestError, match="tags"):
        mgr.prepare_kv_cache([1, 2], [0, 0], [1, 1], tags=tags)
    assert mgr.stats().refusals == 1 and mgr.stats().pages_in_use == 0


# ---------------------------------------------------------------------- the chain
def test_writes_go_through_incrementally_and_drop_drops_everywhere():
    chain, (upper, lower) = _chain(16, 16)
    assert chain.write(1, 0, 6, 0, _fill(_pages(2, 1)), tag=b"t1").stored
    assert chain.write(1, 0, 10, 1, _fill(_pages(2, 2)), tag=b"t2").stored
    assert upper.writes == lower.writes == [(1, 0, 2), (1, 1, 3)]  # only the new pages, in both
    for tier in (upper, lower):
        hp = tier.read(1)
        assert hp.entry == (0, 10, b"t2") and pages_equal(hp.pages, concat_pages([_pages(1, 1), _pages(2, 2)]))
    assert (chain.bytes_used, chain.capacity_bytes, chain.num_users) == (upper.bytes_used, 16 * PAGE, 1)
    assert chain.drop(1) and upper.info(1) is None and lower.info(1) is None and not chain.drop(1)


def test_the_longest_entry_wins_and_is_promoted_into_the_upper_tiers():
    chain, (upper, middle, lower) = _chain(16, 16, 16)
    chain.write(1, 0, 4, 0, _fill(_pages(1, 1)), tag=b"short")
    lower.write(1, 0, 12, 0, _fill(_pages(3, 7)), tag=b"another node's")  # a longer history, same start
    assert chain.info(1) == HostEntry(0, 12, b"another node's")
    hp = chain.read(1)
    assert hp.entry == (0, 12, b"another node's") and pages_equal(hp.pages, _pages(3, 7))
    assert upper.info(1) == middle.info(1) == hp.entry  # promoted
    assert pages_equal(upper.read(1).pages, _pages(3, 7))
    # Equal lengths: the upper tier wins; another start: the upper-most tier's start wins.
    middle.write(1, 0, 12, 0, _fill(_pages(3, 8)), tag=b"middle")
    upper.write(1, 0, 12, 0, _fill(_pages(3, 9)), tag=b"upper")
    assert chain.info(1).tag == b"upper"
    upper.write(1, 40, 2, 0, _fill(_pages(1, 9)), tag=b"restarted window")
    assert chain.info(1) == HostEntry(40, 2, b"restarted window")
    upper.drop(1)
    assert chain.info(1).tag == b"middle"


def test_a_tier_that_fell_behind_is_brought_up_to_date_from_one_that_holds_the_entry():
    chain, (upper, lower) = _chain(3, 16)
    chain.write(1, 0, 8, 0, _fill(_pages(2, 1)))
    chain.write(2, 0, 8, 0, _fill(_pages(2, 2)))  # the upper tier (3 pages) evicts user 1
    assert upper.info(1) is None and lower.info(1) == HostEntry(0, 8)
    result = chain.write(1, 0, 10, 1, _fill(_pages(2, 3)))  # continues the entry the lower tier holds
    assert result.stored and [u for u, _ in result.evicted] == [2]  # the first tier's evictions
    assert lower.writes[-1] == (1, 1, 3) and upper.writes[-1] == (1, 0, 3)  # new pages / whole entry
    expected = concat_pages([_pages(1, 1), _pages(2, 3)])
    assert pages_equal(upper.read(1).pages, expected) and pages_equal(lower.read(1).pages, expected)
    # A tier holding some other entry than the one continued is dropped when nothing can bring it up to date.
    lower.write(3, 0, 4, 0, _fill(_pages(1, 4)))
    upper.write(3, 0, 8, 0, _fill(_pages(2, 5)), tag=b"newer")
    assert not chain.write(3, 0, 40, 1, _fill(_pages(9, 6))).stored  # too large for the upper tier
    assert chain.info(3) == HostEntry(0, 8, b"newer") and lower.info(3) is None


def test_a_promotion_never_evicts_a_user_just_read():
    chain, (upper, lower) = _chain(3, 16)
    chain.write(1, 0, 8, 0, _fill(_pages(2, 1)))  # both tiers
    lower.write(2, 0, 8, 0, _fill(_pages(2, 2)))  # the lower tier only
    first = chain.read(1)  # a view of the upper tier's memory
    second = chain.read(2)  # promoting 2 would have to evict 1 from the upper tier
    assert pages_equal(first.pages, _pages(2, 1)) and pages_equal(second.pages, _pages(2, 2))
    assert upper.info(1) is not None and upper.info(2) is None


def test_manager_over_memory_and_disk_serves_from_either(tmp_path):
    cfg = _config(num_pages=32, host_capacity_bytes=3 * 2 * PAGE, persistent_dir=str(tmp_path),
                  persistent_capacity_bytes=1 << 20)
    with KVCacheManager(cfg) as mgr:
        chain = mgr.host_storage
        assert isinstance(chain, TieredHostStorage) and isinstance(chain.tiers[1], FailOpenStorage)
        for u in range(8):
            serve(mgr, [u], [u], [6])
            mgr.offload_kv_cache([u])
        mgr.evict_kv_cache()
        memory, disk = chain.tiers[0], chain.tiers[1].inner
        assert memory.num_users == 3 and disk.num_users == 8
        start, length = mgr.get_user_kvdata_info(list(range(8)))
        assert start.tolist() == list(range(8)) and length.tolist() == [6] * 8
        serve(mgr, list(range(8)), [u + 6 for u in range(8)], [3] * 8)  # onloads, from disk for most
        for u in range(8):
            for layer in range(2):
                k, v = mgr.read_kv(u, layer)
                ek, ev = expected_kv(cfg.page_layout, u, u, 9, layer)
                assert torch.equal(k, ek) and torch.equal(v, ev)
        stats = mgr.stats()
        assert stats.host_capacity_bytes == memory.capacity_bytes and stats.tier_failures == 0
        mgr.check_invariants()


def test_an_offload_never_appends_to_an_entry_another_node_wrote():
    shared = InMemoryHostStorage(1 << 20)  # stands for a tier several nodes write (Redis)
    node_a, node_b = (KVCacheManager(_config(), host_storage=TieredHostStorage([InMemoryHostStorage(0), shared]))
                      for _ in range(2))
    _serve_tagged(node_a, [1], [0], [10], [b"history A"])
    node_a.offload_kv_cache()
    # Node B serves the user with a rewritten history (its tag check invalidated A's entry): 6 tokens.
    node_b.invalidate_kv_cache([1])
    layout = node_b.config.page_layout
    meta = node_b.prepare_kv_cache([1], [0], [6], tags=[b"history B"])
    append_batch(node_b, meta, new_token_kv(layout, meta, [0], lambda u, p: token_kv(layout, u, p, salt=1)))
    node_b.commit(meta)
    node_b.offload_kv_cache()
    # Node A still holds its (longer) history on the device and extends it: the shared tier holds a
    # same-start shorter entry, but not A's: A rewrites it whole instead of appending to B's pages.
    _serve_tagged(node_a, [1], [10], [4], [b"history A2"])
    node_a.offload_kv_cache()
    hp = shared.read(1)
    kv = hp.pages.kv.permute(2, 1, 0, 3, 4, 5).reshape(2, 2, -1, 1, 2)[:, :, :14]
    assert hp.entry == (0, 14, b"history A2") and torch.equal(kv, token_kv(layout, 1, torch.arange(14)))


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_buffers_a_tier_allocates_in_inference_mode_are_writable_outside_it(kind, tmp_path):
    """The model prepares under torch.inference_mode(): buffers a tier allocates then (a promotion,
    a victim's offload) must take later writes made outside it."""
    tier = InMemoryHostStorage(1 << 20) if kind == "memory" else DiskHostStorage(tmp_path, 1 << 20, fsync=False)
    tier.bind(LAYOUT)
    with torch.inference_mode():
        tier.write(1, 0, 4, 0, _fill(_pages(1, 1)))
        tier.write(2, 0, 4, 0, _fill(_pages(1, 2)))
    tier.drop(2)  # its buffer is kept for reuse
    assert tier.write(1, 0, 4, 0, _fill(_pages(1, 3))).stored  # in place
    assert tier.write(3, 0, 4, 0, _fill(_pages(1, 4))).stored  # the reused buffer
    assert pages_equal(tier.read(1).pages, _pages(1, 3)) and pages_equal(tier.read(3).pages, _pages(1, 4))
    tier.close()


# ---------------------------------------------------------------------- configuration
@pytest.mark.parametrize("field, value, message", [
    ("persistent_dir", "", "persistent_dir"),
    ("persistent_capacity_bytes", -1, "persistent_capacity_bytes"),
    ("redis_url", "localhost:6379", "redis_url"),
    ("redis_capacity_bytes", 1.5, "redis_capacity_bytes"),
    ("redis_ttl_seconds", 0, "redis_ttl_seconds"),
    ("tier_timeout_s", 0, "tier_timeout_s"),
    ("tier_timeout_s", float("inf"), "tier_timeout_s"),
])
def test_tier_settings_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        _config(**{field: value})


def test_redis_needs_a_namespace_and_the_chain_has_only_what_is_configured(tmp_path):
    with pytest.raises(ValueError, match="redis_namespace"):
        _config(redis_url="redis://localhost:6379/0")
    assert isinstance(build_host_storage(_config()), InMemoryHostStorage)  # nothing else configured
    cfg = _config(persistent_dir=tmp_path, redis_url="redis://localhost:1/0", redis_namespace="model-abc",
                  tier_timeout_s=0.25)
    assert cfg.persistent_dir == str(tmp_path)
    chain = build_host_storage(cfg)  # nothing connects before use
    memory, disk, redis_tier = chain.tiers
    assert isinstance(memory, InMemoryHostStorage)
    assert isinstance(disk.inner, DiskHostStorage) and disk.timeout_s == 0.25
    assert type(redis_tier.inner).__name__ == "RedisHostStorage" and redis_tier.inner.namespace == "model-abc"
    chain.close()


def test_a_directory_of_another_model_geometry_is_refused_at_construction(tmp_path):
    KVCacheManager(_config(persistent_dir=str(tmp_path))).close()
    with pytest.raises(ValueError, match="another layout"):
        KVCacheManager(_config(persistent_dir=str(tmp_path), head_dim=4))
    KVCacheManager(_config(persistent_dir=str(tmp_path))).close()  # the refused one released the directory
