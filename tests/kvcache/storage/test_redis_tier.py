"""RedisHostStorage against a real redis-server: the HostKVStorage contract, integrity, sharing, capacity."""
import json
import threading
import time

import pytest
import redis
import torch

from benchmark.kvcache import tiers as bench
from helpers import TINY_LAYOUT_ARGS, host_pages, pages_equal, unique_namespace
from kvcache import (
    FailOpenStorage,
    HostEntry,
    InMemoryHostStorage,
    KVCacheConfig,
    KVCacheManager,
    KVCacheStaleError,
    PageLayout,
    TierDataError,
    TieredHostStorage,
)
from kvcache.page_data import concat_pages
from kvcache.storage.redis_tier import RedisHostStorage
from kvcache.testing import expected_kv, expected_times, serve

LAYOUT = PageLayout(**TINY_LAYOUT_ARGS)
PAGE = LAYOUT.page_nbytes  # 128 bytes


def _store(url, capacity_pages=64, layout=LAYOUT, namespace=None, **kwargs):
    s = RedisHostStorage(url, namespace or unique_namespace(), capacity_pages * layout.page_nbytes, **kwargs)
    s.bind(layout)
    return s


def _random_pages(n, layout=LAYOUT, seed=0):
    """Pages of random bits (NaNs and denormals included): compared bit for bit."""
    return host_pages(layout, n, seed=seed)


def _fill(pages):
    return lambda dst: dst.copy_(pages)


def _keys(client, storage, pattern="*"):
    return sorted(client.scan_iter(f"{storage.prefix}:{pattern}", count=1000))


# ---------------------------------------------------------------------- the contract
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_round_trip_is_bit_identical(redis_server, dtype, page_size):
    layout = PageLayout(num_layers=3, num_heads=2, head_dim=8, page_size=page_size, dtype=dtype)
    s = _store(redis_server, layout=layout)
    pages = _random_pages(5, layout)
    length = 4 * page_size + 1  # last page partial
    assert s.write(9, 3, length, 0, _fill(pages), tag=b"\x00" * 31 + b"\xff").stored
    hp = s.read(9)
    assert hp.entry == HostEntry(3, length, b"\x00" * 31 + b"\xff") == s.info(9)
    assert hp.pages.kv.dtype == dtype and hp.pages.kv.shape == pages.kv.shape
    assert pages_equal(hp.pages, pages)


def test_incremental_write_sends_only_new_pages_and_keeps_the_rest(redis_server):
    s = _store(redis_server)
    client = redis.Redis.from_url(redis_server)
    first = _random_pages(3, seed=1)
    assert s.write(7, 10, 10, 0, _fill(first), tag=b"a").stored  # tokens [10, 20): pages 0, 1, 2 (partial)
    kept = _keys(client, s, "u:7:p:*")[:2]
    new = _random_pages(2, seed=2)
    assert s.write(7, 10, 16, 2, _fill(new), tag=b"b").stored  # page 2 rewritten, page 3 new
    keys = _keys(client, s, "u:7:p:*")
    assert len(keys) == 4 and set(kept) < set(keys)  # pages 0, 1 were not sent again (their keys name the first write)
    hp = s.read(7)
    assert hp.entry == HostEntry(10, 16, b"b")
    assert pages_equal(hp.pages, concat_pages([first[:2], new]))
    assert s.bytes_used == 4 * PAGE


def test_write_from_page_zero_replaces_another_window(redis_server):
    s = _store(redis_server)
    s.write(7, 0, 12, 0, _fill(_random_pages(3)))
    s.write(7, 40, 3, 0, _fill(_random_pages(1, seed=5)))
    hp = s.read(7)
    assert hp.entry == HostEntry(40, 3) and pages_equal(hp.pages, _random_pages(1, seed=5))
    assert s.bytes_used == PAGE


@pytest.mark.parametrize("setup, args, gap", [
    (None, (0, 8, 1), True),  # nothing stored (another node dropped it), writing from page 1
    ((0, 4), (0, 12, 2), True),  # holds one page, writing from page 2
    ((0, 4), (3, 8, 1), True),  # another start (another node replaced it)
    ((0, 4), (0, 0, 0), False),  # empty write
    ((0, 4), (0, 8, 2), False),  # first_page past the end
])
def test_a_gap_is_not_stored_and_a_bad_range_is_refused(redis_server, setup, args, gap):
    """In a shared tier a gap is another writer's doing: a conflict, not an error; a bad range is the caller's."""
    s = _store(redis_server)
    if setup:
        s.write(7, setup[0], setup[1], 0, _fill(_random_pages(1)))
    start, length, first = args
    pages = _random_pages(max(LAYOUT.num_pages(length) - first, 0))
    if gap:
        assert s.write(7, start, length, first, _fill(pages)) == (False, ()) and s.write_conflicts == 1
    else:
        with pytest.raises(ValueError):
            s.write(7, start, length, first, _fill(pages))
    assert s.info(7) == (None if setup is None else HostEntry(*setup))


def test_fill_error_drops_the_entry_and_propagates(redis_server):
    s = _store(redis_server)
    s.write(7, 0, 4, 0, _fill(_random_pages(1)))

    def boom(dst):
        raise RuntimeError("device copy failed")

    with pytest.raises(RuntimeError, match="device copy failed"):
        s.write(7, 0, 8, 1, boom)
    assert s.info(7) is None and s.bytes_used == 0


def test_drop_removes_every_key_of_the_user(redis_server):
    s = _store(redis_server)
    client = redis.Redis.from_url(redis_server)
    s.write(1, 0, 9, 0, _fill(_random_pages(3)))
    s.write(2, 0, 4, 0, _fill(_random_pages(1)))
    assert s.drop(1) and not s.drop(1)
    assert s.info(1) is None and s.read(1) is None
    assert _keys(client, s, "u:1:*") == [] and s.bytes_used == PAGE and s.num_users == 1


def test_namespaces_and_layouts_are_isolated(redis_server):
    other_layout = PageLayout(num_layers=2, num_heads=1, head_dim=2, page_size=4, dtype=torch.bfloat16)
    ns = unique_namespace()
    a = _store(redis_server, namespace=ns)
    b = _store(redis_server)  # another model fingerprint
    c = _store(redis_server, namespace=ns, layout=other_layout)  # same namespace, another page layout
    a.write(5, 0, 4, 0, _fill(_random_pages(1, seed=1)), tag=b"a")
    assert b.info(5) is None and c.info(5) is None
    b.write(5, 8, 8, 0, _fill(_random_pages(2, seed=2)), tag=b"b")
    c.write(5, 0, 4, 0, _fill(_random_pages(1, other_layout, seed=3)), tag=b"c")
    assert (a.info(5), b.info(5), c.info(5)) == (HostEntry(0, 4, b"a"), HostEntry(8, 8, b"b"), HostEntry(0, 4, b"c"))
    assert c.read(5).pages.kv.dtype == torch.bfloat16
    assert b.drop(5) and a.info(5) == HostEntry(0, 4, b"a") and c.info(5) is not None
    assert pages_equal(a.read(5).pages, _random_pages(1, seed=1))


def test_keys_persist_without_ttl_and_expire_with_one(redis_server):
    client = redis.Redis.from_url(redis_server)
    s = _store(redis_server)
    s.write(1, 0, 8, 0, _fill(_random_pages(2)))
    assert {client.pttl(k) for k in _keys(client, s, "u:1:*")} == {-1}  # pending expiry cleared at commit
    t = _store(redis_server, ttl_seconds=30)
    t.write(1, 0, 8, 0, _fill(_random_pages(2)))
    t.write(1, 0, 12, 1, _fill(_random_pages(2)))  # refreshes the kept page 0 as well
    ttls = [client.pttl(k) for k in _keys(client, t, "u:1:*")]
    assert len(ttls) == 4 and all(25_000 < ms <= 30_000 for ms in ttls)
    for k in _keys(client, t, "u:1:*"):
        client.pexpire(k, 5_000)
    t.read(1)  # a read refreshes the TTL too
    assert all(ms > 25_000 for ms in (client.pttl(k) for k in _keys(client, t, "u:1:*")))


# ---------------------------------------------------------------------- capacity and LRU
def test_lru_eviction_spares_the_writer_and_protected_users(redis_server):
    s = _store(redis_server, capacity_pages=4)
    for u in (1, 2, 3):
        s.write(u, 0, 4, 0, _fill(_random_pages(1)), tag=bytes([u]))
    s.read(1)  # 1 becomes most recently used: 2 is now least recently used
    result = s.write(3, 0, 12, 1, _fill(_random_pages(2)))  # 3 grows to 3 pages: needs 1 more than free
    assert result.stored and result.evicted == ((2, HostEntry(0, 4, b"\x02")),)
    assert s.info(2) is None and s.info(1) == HostEntry(0, 4, b"\x01") and s.info(3) == HostEntry(0, 12)
    result = s.write(4, 0, 4, 0, _fill(_random_pages(1)), protect=[1])  # 1 is older than 3, but protected
    assert result.stored and [u for u, _ in result.evicted] == [3]
    assert not s.write(5, 0, 16, 0, _fill(_random_pages(4)), protect=[1]).stored  # does not fit beside 1
    assert s.info(1) is not None and s.info(4) is not None


def test_user_larger_than_the_tier_is_not_stored_and_nothing_changes(redis_server):
    s = _store(redis_server, capacity_pages=2)
    s.write(1, 0, 4, 0, _fill(_random_pages(1)))
    s.write(2, 0, 4, 0, _fill(_random_pages(1)))
    assert s.write(2, 0, 12, 1, _fill(_random_pages(2))) == (False, ())
    assert s.info(1) == HostEntry(0, 4) and s.info(2) == HostEntry(0, 4) and s.bytes_used == 2 * PAGE


def test_namespace_stays_within_capacity_with_two_writers(redis_server):
    """A working set 30x the capacity written by two clients: the page bytes found in Redis never exceed it."""
    ns, capacity_pages = unique_namespace(), 12
    writers = [_store(redis_server, capacity_pages, namespace=ns) for _ in range(2)]
    client = redis.Redis.from_url(redis_server)
    g = torch.Generator().manual_seed(0)
    lengths = {}
    for step in range(120):
        s = writers[step % 2]
        u = int(torch.randint(0, 60, (1,), generator=g))
        old = s.info(u)
        grow = int(torch.randint(1, 9, (1,), generator=g))
        if old is not None and old.length + grow <= 5 * LAYOUT.page_size:
            first, length = old.length // LAYOUT.page_size, old.length + grow
        else:
            first, length = 0, grow
        s.write(u, 0, length, first, _fill(_random_pages(LAYOUT.num_pages(length) - first, seed=step)))
        lengths[u] = length
        page_keys = _keys(client, s, "u:*:p:*")
        stored = sum(client.strlen(k) for k in page_keys)
        assert stored <= capacity_pages * PAGE
        assert stored == s.bytes_used == sum(LAYOUT.num_pages(e.length) * PAGE
                                             for e in map(s.info, range(60)) if e is not None)
    users = [u for u in range(60) if s.info(u) is not None]
    assert 3 <= len(users) == s.num_users < 60
    meta_bytes = sum(client.memory_usage(k) for k in _keys(client, s) if b":p:" not in k)
    # Metadata slack documented in docs/kvcache.md: under 400 bytes per stored user here (small pages).
    assert meta_bytes <= 400 * len(users) + 1024, meta_bytes


# ---------------------------------------------------------------------- integrity
@pytest.mark.parametrize("tamper", ["flip", "truncate", "meta"])
def test_tampered_data_is_a_miss_never_wrong_data(redis_server, tamper):
    s = _store(redis_server)
    client = redis.Redis.from_url(redis_server)
    s.write(3, 0, 12, 0, _fill(_random_pages(3)))
    page = _keys(client, s, "u:3:p:*")[1]
    if tamper == "flip":
        value = bytearray(client.get(page))
        value[17] ^= 0x01
        client.set(page, bytes(value))
    elif tamper == "truncate":
        client.set(page, client.get(page)[:-4])
    else:
        client.hset(f"{s.prefix}:u:3:meta", "length", "999")
    with pytest.raises(TierDataError):
        s.read(3)
    assert s.info(3) is None and s.read(3) is None and s.bytes_used == 0  # dropped: the next visit recomputes
    assert s.corrupt_reads == 1


def test_a_page_lost_under_the_reader_is_a_miss(redis_server):
    s = _store(redis_server)
    client = redis.Redis.from_url(redis_server)
    s.write(3, 0, 12, 0, _fill(_random_pages(3)))
    client.delete(_keys(client, s, "u:3:p:*")[0])  # e.g. evicted by a Redis maxmemory policy
    assert s.read(3) is None and s.info(3) is None and s.lost_reads == 1


def test_unreachable_server_raises_quickly(private_redis_server):
    s = _store(private_redis_server.url, timeout_s=0.2)
    s.write(1, 0, 4, 0, _fill(_random_pages(1)))
    private_redis_server.stop()
    for call in (lambda: s.info(1), lambda: s.read(1), lambda: s.write(1, 0, 4, 0, _fill(_random_pages(1)))):
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            call()
        assert time.monotonic() - t0 < 2.0


# ---------------------------------------------------------------------- several writers
def test_last_complete_write_wins_and_leaks_no_pages(redis_server):
    ns = unique_namespace()
    a, b = _store(redis_server, namespace=ns), _store(redis_server, namespace=ns)
    client = redis.Redis.from_url(redis_server)
    a.write(1, 0, 12, 0, _fill(_random_pages(3, seed=1)), tag=b"a")
    b.write(1, 0, 8, 0, _fill(_random_pages(2, seed=2)), tag=b"b")
    assert a.info(1) == HostEntry(0, 8, b"b")
    assert pages_equal(a.read(1).pages, _random_pages(2, seed=2))
    assert len(_keys(client, a, "u:1:p:*")) == 2 and a.bytes_used == 2 * PAGE


def test_incremental_write_on_a_replaced_base_is_refused(redis_server):
    """Node A extends the entry it read while node B replaces it: B's complete entry stays, A's is not stored."""
    ns = unique_namespace()
    a, b = _store(redis_server, namespace=ns), _store(redis_server, namespace=ns)
    client = redis.Redis.from_url(redis_server)
    a.write(1, 0, 8, 0, _fill(_random_pages(2, seed=1)))

    def fill_while_b_writes(dst):
        b.write(1, 0, 12, 0, _fill(_random_pages(3, seed=2)), tag=b"b")
        assert a.read(1).entry == HostEntry(0, 12, b"b")  # readers see B's entry whole, never A's pages
        dst.copy_(_random_pages(1, seed=3))

    assert a.write(1, 0, 12, 2, fill_while_b_writes, tag=b"a") == (False, ())
    assert a.write_conflicts == 1 and a.counters()["write_conflicts"] == 1
    hp = a.read(1)
    assert hp.entry == HostEntry(0, 12, b"b") and pages_equal(hp.pages, _random_pages(3, seed=2))
    assert len(_keys(client, a, "u:1:p:*")) == 3  # A's uploaded page was deleted


def test_concurrent_writers_and_a_reader_never_mix_writes(redis_server):
    """Two writers rewrite one user with pages that all hold their write's number; every read is uniform."""
    ns, stop, errors, seen = unique_namespace(), threading.Event(), [], set()

    def writer(k):
        s = _store(redis_server, namespace=ns)
        i = 0
        try:
            while not stop.is_set():
                i += 1
                value = float(k * 100_000 + i)
                n = 1 + i % 4
                first = 0
                info = s.info(1)
                if i % 3 == 0 and info is not None and info.length == 4 * n - 4:
                    first = n - 1  # incremental: valid only if the whole entry holds one value (checked by tags)
                # The other writer may change the entry between info() and write(): a gap, not stored.
                s.write(1, 0, 4 * n, first, lambda dst, value=value: dst.kv.fill_(value), tag=str(value).encode())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader():
        s = _store(redis_server, namespace=ns)
        try:
            while not stop.is_set():
                hp = s.read(1)
                if hp is None:
                    continue
                values = hp.pages.kv.reshape(hp.pages.num_pages, -1)
                # An incremental write keeps the old pages: the tag names the newest page's value.
                assert float(values[-1, 0]) == float(hp.tag.decode())
                assert all(bool((row == row[0]).all()) for row in values)
                assert hp.pages.num_pages == LAYOUT.num_pages(hp.length)
                seen.add(hp.tag)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in (1, 2)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(seen) > 5
    s = _store(redis_server, namespace=ns)
    client = redis.Redis.from_url(redis_server)
    assert len(_keys(client, s, "u:1:p:*")) == LAYOUT.num_pages(s.info(1).length)  # nothing leaked


# ---------------------------------------------------------------------- two inference nodes
CFG = KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, page_size=4, num_pages=64)


def _assert_cached(mgr, user, start, length):
    s, n = mgr.get_user_kvdata_info([user])
    assert (int(s), int(n)) == (start, length)
    assert torch.equal(mgr.read_times(user), expected_times(user, start, length))
    for layer in range(CFG.num_layers):
        k, v = mgr.read_kv(user, layer)
        ek, ev = expected_kv(CFG.page_layout, user, start, length, layer)
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_a_user_served_by_one_node_is_reused_by_another(redis_server):
    ns = unique_namespace()
    node_a = KVCacheManager(CFG, host_storage=RedisHostStorage(redis_server, ns, 1 << 20))
    node_b = KVCacheManager(CFG, host_storage=RedisHostStorage(redis_server, ns, 1 << 20))
    serve(node_a, [1, 2], [0, 0], [10, 7])
    node_a.offload_kv_cache()
    serve(node_a, [1], [10], [5])
    node_a.offload_kv_cache([1])  # incremental
    _assert_cached(node_b, 1, 0, 15)
    _assert_cached(node_b, 2, 0, 7)
    meta = serve(node_b, [1], [15], [3])  # the user returns to node B: its 15 tokens are onloaded, 3 computed
    assert meta.cached_lengths.tolist() == [15] and node_b.stats().tokens_reused == 15
    node_b.offload_kv_cache([1])
    node_a.evict_kv_cache([1])
    _assert_cached(node_a, 1, 0, 18)
    node_a.check_invariants()
    node_b.check_invariants()


def _nodes(url, count=2, **config):
    """Managers configured like inference nodes: an in-memory tier, then the shared Redis tier."""
    cfg = KVCacheConfig(**{**CFG.__dict__, "redis_url": url, "redis_namespace": unique_namespace(),
                           "redis_capacity_bytes": 1 << 20, **config})
    return [KVCacheManager(cfg) for _ in range(count)]


def test_nodes_configured_with_a_redis_url_share_users(redis_server):
    node_a, node_b = _nodes(redis_server)
    assert isinstance(node_a.host_storage, TieredHostStorage)
    serve(node_a, [1], [0], [9])
    node_a.offload_kv_cache()
    _assert_cached(node_b, 1, 0, 9)  # node B's memory tier is empty: from Redis
    serve(node_b, [1], [9], [4])
    node_b.offload_kv_cache()  # write-through: memory and Redis
    node_a.evict_kv_cache([1])
    # Node A's memory tier holds 9 tokens, Redis 13 with the same start: the longest wins.
    _assert_cached(node_a, 1, 0, 13)
    assert serve(node_a, [1], [13], [2]).cached_lengths.tolist() == [13]
    for node in (node_a, node_b):
        node.check_invariants()
        node.close()


def test_a_tampered_page_is_recomputed_never_served(redis_server):
    """Through FailOpenStorage (what the config builds) a corrupt entry is a miss, counted once."""
    ns = unique_namespace()
    node_a = KVCacheManager(CFG, host_storage=RedisHostStorage(redis_server, ns, 1 << 20))
    node_b = KVCacheManager(CFG, host_storage=FailOpenStorage(RedisHostStorage(redis_server, ns, 1 << 20), "redis"))
    serve(node_a, [4], [0], [11])
    node_a.offload_kv_cache()
    client = redis.Redis.from_url(redis_server)
    page = sorted(client.scan_iter(f"{node_a.host_storage.prefix}:u:4:p:*"))[-1]
    client.setrange(page, 5, b"\x7f")
    start, length = node_b.get_user_kvdata_info([4])
    assert (int(start), int(length)) == (0, 11)  # the meta is intact: reported...
    with pytest.raises(KVCacheStaleError):  # ...but its pages fail their checksum: refused, never onloaded
        node_b.prepare_kv_cache([4], [11], [1])
    assert node_b.stats().tier_corrupt_reads == 1
    _assert_cached(node_b, 4, 0, 0)  # dropped: the next plan recomputes the history
    serve(node_b, [4], [0], [12])
    _assert_cached(node_b, 4, 0, 12)


def _replay(mgr, visits, on_visit=None):
    """Serve (user, history end) visits as a session does: continue what is cached, else recompute from 0."""
    layout = mgr.config.page_layout
    for step, (u, end) in enumerate(visits):
        if on_visit:
            on_visit(step)
        start, length = (int(x) for x in mgr.get_user_kvdata_info([u]))
        cached_end = start + length if length else 0
        serve(mgr, [u], [cached_end], [end - cached_end])
        mgr.offload_kv_cache([u])
        for layer in range(layout.num_layers):
            k, v = mgr.read_kv(u, layer)
            ek, ev = expected_kv(layout, u, 0, end, layer)
            assert torch.equal(k, ek) and torch.equal(v, ev), (step, u, end)


def _visits(num_users=6, rounds=5):
    ends = [0] * num_users
    out = []
    for r in range(rounds):
        for u in range(num_users):
            ends[u] += 3 + (u * 7 + r * 5) % 9
            out.append((u, ends[u]))
    return out


def test_stopping_the_server_mid_replay_costs_recomputation_not_errors(private_redis_server, caplog):
    """The device holds two users: the others come back from Redis until it stops, then are recomputed."""
    visits = _visits()
    small = KVCacheConfig(**{**CFG.__dict__, "num_pages": 2 * 16})
    reference = KVCacheManager(small, host_storage=InMemoryHostStorage(1 << 20))
    _replay(reference, visits)

    tier = FailOpenStorage(RedisHostStorage(private_redis_server.url, unique_namespace(), 1 << 20, timeout_s=0.2),
                           "redis")
    mgr = KVCacheManager(small, host_storage=tier)
    stop_at = len(visits) // 2
    reused_before_stop = []

    def maybe_stop(step):
        if step == stop_at:
            reused_before_stop.append(mgr.stats().tokens_reused)
            private_redis_server.stop()

    _replay(mgr, visits, on_visit=maybe_stop)  # no exception, every visit's K/V exact
    stats = mgr.stats()
    assert reused_before_stop[0] > 0  # Redis served returning users before it stopped
    assert stats.tier_failures > 0  # counted, and said once (the replay is shorter than the retry period)
    assert any("'redis' failed" in r.getMessage() for r in caplog.records if r.name == "kvcache")
    assert stats.tokens_appended > reference.stats().tokens_appended  # recomputed what Redis no longer serves
    for u in range(6):  # what is still cached (on the device) is the reference's; the rest is gone, not wrong
        for layer in range(CFG.num_layers):
            k, v = mgr.read_kv(u, layer)
            ref_k, ref_v = reference.read_kv(u, layer)
            assert len(k) == 0 or (torch.equal(k, ref_k) and torch.equal(v, ref_v))


def test_reads_recover_after_the_server_drops_the_connections(redis_server):
    s = _store(redis_server)
    s.write(2, 0, 9, 0, _fill(_random_pages(3, seed=4)))
    assert s.read(2) is not None
    redis.Redis.from_url(redis_server).client_kill_filter(_type="normal", skipme=True)
    for _ in range(2):  # the first call may notice the dead connection; the next one reconnects
        try:
            hp = s.read(2)
            break
        except redis.ConnectionError:
            continue
    assert pages_equal(hp.pages, _random_pages(3, seed=4))


def test_tier_benchmark_runs_at_tiny_sizes(redis_server, tmp_path, capsys):
    """Keeps benchmark/kvcache/tiers.py from rotting (the real run is in docs/kvcache.md)."""
    out = tmp_path / "tiers.json"
    assert bench.main(["--histories", "32", "64", "--repeats", "1", "--redis_url", redis_server,
                       "--workdir", str(tmp_path), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {(r["tier"], r["history"]) for r in result["rows"]} == {(t, h) for t in bench.TIERS for h in (32, 64)}
    assert all(r["reload_ms"] > 0 and r["recompute_ms"] > 0 for r in result["rows"])
    assert set(result["crossover"]) == set(bench.TIERS)
    assert "recompute/reload" in capsys.readouterr().out
    assert not list(redis.Redis.from_url(redis_server).scan_iter("hstu:tier-benchmark-*:u:*"))  # cleaned up


def test_tier_benchmark_times_each_codec_against_raw(tmp_path):
    """--kv_codecs: every codec a tier of its own, and its reload as a multiple of the raw one's."""
    out = tmp_path / "tiers.json"
    assert bench.main(["--tiers", "memory", "--histories", "64", "--repeats", "1", "--kv_codecs", "raw", "bf16",
                       "sparse:keep=20", "--workdir", str(tmp_path), "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["tier"]: r["reload_ms"] for r in result["rows"]}
    assert set(rows) == {"memory", "memory bf16", "memory sparse:keep=20,merge=1,recent=1,score=vnorm,values=raw"}
    for name, ratio in result["reload_vs_raw"].items():
        tier = name.split(" @ ")[0]
        assert ratio == pytest.approx(rows[tier] / rows["memory"])
    assert len(result["reload_vs_raw"]) == 2


def test_tier_benchmark_with_an_attention_window_stores_and_moves_only_what_the_window_reads(tmp_path):
    """--attention_window: the user's unread pages are released and offloaded as zeros, which
    `zstd-channel` stores as no bytes; a negative window is refused by name."""
    stored = {}
    for window in (0, 16):
        out = tmp_path / f"tiers-{window}.json"
        assert bench.main(["--tiers", "memory", "--histories", "256", "--repeats", "1", "--kv_codecs", "raw",
                           "zstd-channel", "--attention_window", str(window), "--workdir", str(tmp_path),
                           "--output", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["attention_window"] == window
        stored[window] = {r["tier"]: r["stored_bytes"] for r in result["rows"]}
    assert stored[16]["memory"] == stored[0]["memory"] > 0  # raw pages: the zeros cost their size
    assert stored[16]["memory zstd-channel"] < stored[0]["memory zstd-channel"] / 4
    with pytest.raises(SystemExit):
        bench.main(["--attention_window", "-1"])


def _serve_returning_users(url, ns, users):
    """A second node (the config's chain: FailOpenStorage around Redis) serves every user again."""
    node = KVCacheManager(CFG, host_storage=FailOpenStorage(RedisHostStorage(url, ns, 1 << 20), "redis"))
    start, length = node.get_user_kvdata_info(users)
    serve(node, users, start + length, [2] * len(users))
    return node


@pytest.mark.parametrize("other_type", ["string", "list"])
def test_a_meta_key_of_the_wrong_type_costs_only_its_user(redis_server, other_type):
    """One user's meta key holding another Redis type (WRONGTYPE) is one corrupt entry: dropped, counted,
    and every other user is served from the tier as if it were not there."""
    users = list(range(6))
    client = redis.Redis.from_url(redis_server)
    stats = []
    for corrupt in (False, True):
        ns = unique_namespace()
        writer = KVCacheManager(CFG, host_storage=RedisHostStorage(redis_server, ns, 1 << 20))
        serve(writer, users, [0] * 6, [5 + 3 * u for u in users])
        writer.offload_kv_cache()
        meta_key = f"{writer.host_storage.prefix}:u:3:meta"
        if corrupt:
            client.delete(meta_key)
            client.set(meta_key, b"x") if other_type == "string" else client.rpush(meta_key, b"x")
        node = _serve_returning_users(redis_server, ns, users)
        stats.append(node.stats())
        for u in users:
            length = 2 if corrupt and u == 3 else 5 + 3 * u + 2
            _assert_cached(node, u, 0, length)
    clean, bad = stats
    assert bad.hits == clean.hits - 1 == len(users) - 1
    user_3_bytes = CFG.page_layout.num_pages(5 + 9) * CFG.page_layout.page_nbytes
    assert bad.onloaded_bytes == clean.onloaded_bytes - user_3_bytes
    assert bad.tier_corrupt_reads == 1 and bad.tier_failures == 0 and clean.tier_corrupt_reads == 0
    assert client.type(meta_key) == b"none"  # removed


def test_the_tier_drops_a_wrong_type_meta_key_on_every_path(redis_server):
    s = _store(redis_server)
    client = redis.Redis.from_url(redis_server)
    for call in (lambda: s.info(5), lambda: s.read(5)):
        client.set(f"{s.prefix}:u:5:meta", b"x")
        with pytest.raises(TierDataError, match="holds a Redis string"):
            call()
        assert client.type(f"{s.prefix}:u:5:meta") == b"none"
    client.lpush(f"{s.prefix}:u:5:meta", b"x")
    assert s.drop(5) and client.type(f"{s.prefix}:u:5:meta") == b"none"
    assert s.write(6, 0, 4, 0, _fill(_random_pages(1))).stored
    assert s.bytes_used == PAGE and s.num_users == 1


def test_local_server_starts_from_a_relative_workdir(tmp_path, monkeypatch):
    from kvcache.local_redis import LocalRedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    monkeypatch.chdir(tmp_path)
    with LocalRedisServer("relative/redis") as server:
        assert redis.Redis.from_url(server.url).ping()
    assert (tmp_path / "relative" / "redis" / "redis.log").exists()


def test_invariants_hold_when_another_node_extends_a_shared_user(redis_server):
    """Two managers over one Redis namespace: B serves the user further than A's device copy.
    A's copy is stale, not broken: its bookkeeping invariants still hold, and A's next offload
    does not clobber B's longer entry."""
    namespace = unique_namespace()
    config = dict(num_layers=LAYOUT.num_layers, num_heads=LAYOUT.num_heads, head_dim=LAYOUT.head_dim,
                  page_size=LAYOUT.page_size, num_pages=32, host_capacity_bytes=0,
                  redis_url=redis_server, redis_namespace=namespace)
    with KVCacheManager(KVCacheConfig(**config)) as a, KVCacheManager(KVCacheConfig(**config)) as b:
        serve(a, [7], [0], [6])
        a.offload_kv_cache([7])
        serve(b, [7], [6], [5])  # B onloads A's 6 tokens from Redis and adds 5
        b.offload_kv_cache([7])
        a.check_invariants()
        b.check_invariants()
        a.offload_kv_cache([7])  # A's copy is a stale prefix: B's longer entry stays
        assert a.stats().superseded_offloads == 1
        a.evict_kv_cache([7])  # A synced its copy before: evicting it writes nothing
        with KVCacheManager(KVCacheConfig(**config)) as c:
            assert [int(x) for x in c.get_user_kvdata_info([7])[1]] == [11]
            serve(c, [7], [11], [1])  # and it is B's K/V that come back
            for layer in range(LAYOUT.num_layers):
                k, v = c.read_kv(7, layer)
                expected_k, expected_v = expected_kv(LAYOUT, 7, 0, 12, layer)
                assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_events_report_the_nodes_own_tiers_not_the_shared_one(redis_server):
    """A user the node's memory tier cannot hold lives on only in Redis after an eviction: that is
    every node's fallback, so the node reports it gone (the locality index must not send the user
    back here for a host hit it does not have). A user the memory tier holds is reported on host."""
    from kvcache import CacheEvent, CacheLocation

    heard = []
    config = KVCacheConfig(num_layers=LAYOUT.num_layers, num_heads=LAYOUT.num_heads, head_dim=LAYOUT.head_dim,
                           page_size=LAYOUT.page_size, num_pages=16, host_capacity_bytes=2 * PAGE,
                           redis_url=redis_server, redis_namespace=unique_namespace())
    with KVCacheManager(config, event_listener=heard.extend) as mgr:
        serve(mgr, [1, 2], [0, 0], [6, 12])  # user 2 needs 3 pages: more than the memory tier
        mgr.offload_kv_cache([1, 2])
        assert mgr._host.own_info(2) is None and mgr._host.info(2) == HostEntry(0, 12, mgr.get_user_tags([2])[0])
        assert mgr._host.own_info(1) == mgr._host.info(1)
        heard.clear()
        mgr.evict_kv_cache([1, 2])
        assert heard == [CacheEvent(1, CacheLocation.HOST, 0, 6), CacheEvent(2, CacheLocation.NONE, 0, 0)]
        assert [int(x) for x in mgr.get_user_kvdata_info([1, 2])[1]] == [6, 12]  # both still reusable
