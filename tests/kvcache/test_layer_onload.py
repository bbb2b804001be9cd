"""Per-layer onload: host pages whose layers are contiguous blocks, copies per layer, one event per layer."""
import pytest
import torch

from helpers import host_pages, pages_equal
from kvcache import DiskHostStorage, InMemoryHostStorage, KVCacheConfig, KVCacheManager, PageData
from kvcache.page_data import blob_pages, concat_pages, empty_kv
from kvcache.pool import DevicePagePool
from kvcache.testing import expected_kv, expected_times, serve

NUM_LAYERS = 3
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="the onload stream and its events exist on CUDA only")


def _config(device="cpu", **kw):
    return KVCacheConfig(num_layers=NUM_LAYERS, num_heads=2, head_dim=4, page_size=4, num_pages=64, device=device,
                         host_capacity_bytes=1 << 20, **kw)


def _random_pages(layout, n, seed):
    return host_pages(layout, n, seed=seed)


def _assert_holds(mgr, users, start, length):
    layout = mgr.config.page_layout
    for u in users:
        assert torch.equal(mgr.read_times(u).cpu(), expected_times(u, start, length)), u
        for layer in range(NUM_LAYERS):
            k, v = mgr.read_kv(u, layer)
            k_want, v_want = expected_kv(layout, u, start, length, layer)
            assert torch.equal(k.cpu(), k_want) and torch.equal(v.cpu(), v_want), (u, layer)


def test_memory_tier_hands_out_each_layer_of_a_user_as_one_block_and_keeps_them_through_growth():
    layout = _config().page_layout
    tier = InMemoryHostStorage(64 * layout.page_nbytes)
    tier.bind(layout)
    first, more = _random_pages(layout, 3, 1), _random_pages(layout, 9, 2)
    assert tier.write(7, 0, 12, 0, lambda dst: dst.copy_(first)).stored
    assert tier.write(7, 0, 34, 2, lambda dst: dst.copy_(more[2:])).stored  # grows into a new range
    pages = tier.read(7).pages
    assert pages.kv.shape == (9, *layout.page_shape) and pages.times.shape == (9, layout.page_size)
    assert pages_equal(pages[:2], first[:2]) and pages_equal(pages[2:], more[2:])
    kv = pages.kv
    block = kv[:, 0].numel() * kv.element_size()  # one layer of the user, every page
    for layer in range(NUM_LAYERS):
        assert kv[:, layer].is_contiguous()
        assert kv[:, layer].data_ptr() - kv.data_ptr() >= layer * block  # blocks in layer order, apart


def _layer_major(layout, pages, capacity):
    """`pages` as the in-memory tier hands them out: a view of a range of `capacity` pages, layer-major."""
    n = pages.num_pages
    storage = empty_kv(layout, capacity).view(-1).view(NUM_LAYERS, capacity, 2, *layout.page_shape[2:])
    storage[:, :n].copy_(pages.kv.transpose(0, 1))
    return PageData(storage[:, :n].transpose(0, 1), pages.times.clone())


def test_pool_moves_pages_of_either_layout_bit_exactly_and_together(device):
    layout = _config().page_layout
    pool = DevicePagePool(layout, 16, torch.device(device))
    first, second = _random_pages(layout, 3, 3), blob_pages(layout, 2).copy_(_random_pages(layout, 2, 4))
    from_tier = _layer_major(layout, first, 8)
    assert not from_tier.kv.is_contiguous() and all(from_tier.kv[:, layer].is_contiguous() for layer in range(NUM_LAYERS))
    pages = pool.alloc(5)[::-1]  # scattered, in reverse order
    pool.copy_in([(pages[:3], from_tier), (pages[3:], second)])  # page blobs `second`
    pool.wait_for_onloads()
    src = concat_pages([first, second])
    bits = lambda t: t.contiguous().view(torch.uint8)  # random bits: NaNs compare by bits
    for layer in range(NUM_LAYERS):
        k, v = pool.k_cache(layer)[list(pages)].cpu(), pool.v_cache(layer)[list(pages)].cpu()
        assert torch.equal(bits(k), bits(src.kv[:, layer, 0])) and torch.equal(bits(v), bits(src.kv[:, layer, 1]))
    assert torch.equal(pool.times_cache()[list(pages)].cpu(), src.times)
    zeros = PageData(torch.zeros_like(src.kv), torch.zeros_like(src.times))
    for dst in (blob_pages(layout, 5), _layer_major(layout, zeros, 7)):
        pool.copy_out(pages, dst)
        assert pages_equal(dst, src)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_onloaded_users_read_back_exactly_from_either_tier(device, tier, tmp_path):
    cfg = _config(device)
    host = InMemoryHostStorage(1 << 20) if tier == "memory" else DiskHostStorage(tmp_path, 1 << 20)
    with KVCacheManager(cfg, host_storage=host) as mgr:
        serve(mgr, [1, 2, 3], [0, 0, 0], [9, 13, 4])
        mgr.offload_kv_cache()
        mgr.evict_kv_cache()
        meta = mgr.prepare_kv_cache([1, 2, 3], [9, 13, 4], [0, 0, 0])  # onloads, layer by layer on CUDA
        mgr.commit(meta)
        assert mgr.stats().onloaded_bytes == (3 + 4 + 1) * cfg.page_layout.page_nbytes
        _assert_holds(mgr, [1], 0, 9)
        _assert_holds(mgr, [2], 0, 13)
        mgr.check_invariants()
    host.close()


def _onload_held_back(mgr, users, lengths):
    """Evict the users, clear the freed pages, and onload them again behind a long sleep on the onload
    stream: a read of the pool that does not wait for the copies sees zeros."""
    mgr.offload_kv_cache()
    mgr.evict_kv_cache()
    mgr._pool.kv.zero_()
    with torch.cuda.stream(mgr._pool._onload_stream):
        torch.cuda._sleep(50_000_000)
    mgr.commit(mgr.prepare_kv_cache(users, lengths, [0] * len(users)))


@cuda_only
def test_compute_waits_for_the_layer_it_reads_and_only_that_layer():
    with KVCacheManager(_config("cuda")) as mgr:
        serve(mgr, [1, 2], [0, 0], [40, 24])
        _onload_held_back(mgr, [1, 2], [40, 24])
        events = mgr._pool._onload_events
        assert events.unwaited_layers() == list(range(NUM_LAYERS))
        mgr.k_cache(0)
        assert events.unwaited_layers() == list(range(1, NUM_LAYERS))  # layer 0 waited for, no other
        for layer in range(NUM_LAYERS):
            k, v = mgr.read_kv(1, layer)  # reads through the pool's layer `layer` on the current stream
            k_want, v_want = expected_kv(mgr.config.page_layout, 1, 0, 40, layer)
            assert torch.equal(k.cpu(), k_want) and torch.equal(v.cpu(), v_want), layer
            assert events.unwaited_layers() == list(range(layer + 1, NUM_LAYERS))


@cuda_only
def test_an_offload_waits_for_the_onload_and_a_replay_for_every_layer():
    with KVCacheManager(_config("cuda")) as mgr:
        layout = mgr.config.page_layout
        serve(mgr, [1], [0], [30])
        _onload_held_back(mgr, [1], [30])
        mgr.host_storage.drop(1)
        mgr.offload_kv_cache([1])  # right behind the held-back copies: must store the onloaded pages, not zeros
        pages = mgr.host_storage.read(1).pages.kv
        for layer in range(NUM_LAYERS):
            k_want, v_want = expected_kv(layout, 1, 0, 30, layer)
            assert torch.equal(pages[:, layer, 0].reshape(-1, *k_want.shape[1:])[:30], k_want)
            assert torch.equal(pages[:, layer, 1].reshape(-1, *v_want.shape[1:])[:30], v_want)
        _onload_held_back(mgr, [1], [30])
        mgr.wait_for_onloads()  # what a CUDA graph replay does: it reads the pool without asking k_cache
        assert mgr._pool._onload_events.unwaited_layers() == []
        snapshot = mgr._pool.kv.clone()  # on the current stream, after every layer's event
        torch.cuda.synchronize()
        assert torch.equal(snapshot, mgr._pool.kv)
        _assert_holds(mgr, [1], 0, 30)


@cuda_only
def test_cuda_offloads_of_a_batch_leave_in_one_staged_copy(monkeypatch):
    """On CUDA the users offloaded together leave the device in one gather and copy (one host wait),
    into pinned staging, and every tier holds what the device held."""
    mgr = KVCacheManager(_config("cuda", eviction_policy="lru"))
    assert mgr._residency.staging is not None and mgr._residency.staging.pinned
    users = list(range(8))
    serve(mgr, users, [0] * 8, [9] * 8)
    copies = []
    copy_out = DevicePagePool.copy_out
    monkeypatch.setattr(DevicePagePool, "copy_out", lambda self, pages, dst: copies.append(len(pages)) or
                        copy_out(self, pages, dst))
    mgr.offload_kv_cache()
    assert copies == [8 * 3]  # 9 tokens = 3 pages a user, one copy for all
    mgr.evict_kv_cache()
    _assert_holds(mgr, users, 0, 9)  # read back from the host tier
    serve(mgr, users, [9] * 8, [2] * 8)  # onloaded, then 2 more tokens
    _assert_holds(mgr, users, 0, 11)
    mgr.close()


@cuda_only
@pytest.mark.parametrize("codec", ["int8", "int8:group=token", "bf16", "zstd"])
def test_cuda_onload_of_encoded_pages_equals_the_cpu_pools(codec):
    """int8 and bf16 pages cross the bus encoded and are decoded into the pool's pages on the onload
    stream (int8: the Triton kernel); zstd's are decoded on the host first. Either way the reloaded K/V
    equal the CPU pool's, which decodes into its pages (int8, symmetric: q * scale rounded once on
    both; int8:group=token: fbgemm's kernel on the CPU and the Triton kernel's fused multiply-add on
    CUDA both round q * scale + min once)."""
    reloaded = {}
    for device in ("cpu", "cuda"):
        with KVCacheManager(_config(device, kv_codec=codec)) as mgr:
            serve(mgr, [1, 2], [0, 0], [9, 13])
            mgr.offload_kv_cache()
            mgr.evict_kv_cache()
            mgr.commit(mgr.prepare_kv_cache([1, 2], [9, 13], [0, 0]))
            reloaded[device] = [torch.cat(mgr.read_kv(u, layer)).cpu() for u in (1, 2) for layer in range(NUM_LAYERS)]
            mgr.check_invariants()
    assert all(torch.equal(a, b) for a, b in zip(reloaded["cpu"], reloaded["cuda"]))
