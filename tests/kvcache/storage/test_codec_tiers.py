"""Tiers storing encoded pages: round trips with incremental writes on every tier, the codec's spec
stored per entry (a tier configured with another codec still decodes it), bytes counted encoded."""
import pytest
import torch

from helpers import unique_namespace
from kvcache import DiskHostStorage, PageLayout
from kvcache.codecs import get_codec
from kvcache.page_data import concat_pages, decoded, empty_pages
from kvcache.storage.encoded_memory_tier import EncodedMemoryStorage
from kvcache.storage.redis_tier import RedisHostStorage

LAYOUT = PageLayout(num_layers=2, num_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def _pages(n, seed):
    g = torch.Generator().manual_seed(seed)
    pages = empty_pages(LAYOUT, n)
    pages.kv.copy_(torch.randn(pages.kv.shape, generator=g))
    pages.times.copy_(torch.randint(0, 1 << 40, pages.times.shape, generator=g))
    return pages


def _tier(kind, codec, tmp_path, redis_url=None, namespace=None):
    if kind == "memory":
        tier = EncodedMemoryStorage(1 << 20, codec)
    elif kind == "disk":
        tier = DiskHostStorage(tmp_path / "kv", 1 << 20, fsync=False, codec=codec)
    else:
        tier = RedisHostStorage(redis_url, namespace, 1 << 20, codec=codec)
    tier.bind(LAYOUT)
    return tier


def _expected(codec, pages):
    c = get_codec(codec)
    return c.decode(LAYOUT, c.encode(LAYOUT, pages))


@pytest.fixture(params=["memory", "disk", "redis"])
def kind(request):
    return request.param


@pytest.fixture
def make_tier(kind, tmp_path, request):
    url = request.getfixturevalue("redis_server") if kind == "redis" else None
    namespace = unique_namespace("codec")
    tiers = []

    def make(codec):
        tiers.append(_tier(kind, codec, tmp_path, url, namespace))
        return tiers[-1]

    yield make
    for t in tiers:
        t.close()


@pytest.mark.parametrize("codec", ["zstd", "zstd:values=bf16", "zstd-channel", "int8", "mixed",
                                   "sparse:keep=50,merge=0,recent=0,values=int8"])
def test_incremental_round_trip_decodes_what_was_encoded(make_tier, codec):
    tier = make_tier(codec)
    held, length = _pages(0, 0), 0
    for visit, new in enumerate([3, 6, 1, 9]):
        first = length // 4
        length += new
        pages = _pages(-(-length // 4) - first, visit)
        assert tier.write(7, 0, length, first, lambda dst, p=pages: dst.copy_(p)).stored
        held = concat_pages([held[:first], pages])
        got = tier.read(7)
        assert got.entry == (0, length, b"")
        want = _expected(codec, held)
        assert torch.equal(decoded(got.pages).kv, want.kv) and torch.equal(decoded(got.pages).times, held.times)
    if codec != "zstd-channel" and not codec.startswith("zstd"):  # fixed-size encodings: the encoded bytes (sparse: pages alike)
        raw_bytes = held.num_pages * LAYOUT.page_nbytes
        assert tier.bytes_used < raw_bytes / 2


def test_an_entry_is_read_with_the_codec_that_wrote_it(make_tier, kind):
    if kind == "memory":
        pytest.skip("a process-local tier never holds another codec's entries")
    pages = _pages(3, 1)
    writer = make_tier("int8")
    assert writer.write(5, 0, 10, 0, lambda dst: dst.copy_(pages)).stored
    writer.close()
    reader = make_tier("zstd")  # the same directory / namespace, configured with another codec
    got = reader.read(5)
    assert torch.equal(decoded(got.pages).kv, _expected("int8", pages).kv)
    # continuing it rewrites the entry whole in the reader's codec: no entry mixes encodings
    more = _pages(2, 2)  # pages 2 and 3 of 13 tokens
    assert reader.write(5, 0, 13, 2, lambda dst: dst.copy_(more)).stored
    got = reader.read(5)
    want = concat_pages([_expected("int8", pages)[:2], more])
    assert torch.equal(decoded(got.pages).kv, want.kv)
    assert torch.equal(decoded(got.pages).times, concat_pages([pages[:2], more]).times)


def test_a_write_that_does_not_fit_encoded_changes_nothing(tmp_path):
    tier = EncodedMemoryStorage(3 * 1000, "bf16")  # a bf16 page of this layout is 560 bytes
    tier.bind(LAYOUT)
    assert tier.write(1, 0, 16, 0, lambda dst: dst.copy_(_pages(4, 0))).stored
    result = tier.write(2, 0, 24, 0, lambda dst: dst.copy_(_pages(6, 1)), protect={1})
    assert not result.stored and tier.info(2) is None and tier.info(1) is not None


def test_copy_users_puts_each_user_in_the_destinations_encoded_tier():
    """kvcache.testing.copy_users (the codec report's warm start): the destination holds each user's range,
    tag, times and K/V (as its codec keeps them), in its host tier and not on its device."""
    from kvcache import KVCacheConfig, KVCacheManager
    from kvcache.testing import copy_users, serve

    geometry = dict(num_layers=2, num_heads=2, head_dim=8, page_size=4, num_pages=32)
    with KVCacheManager(KVCacheConfig(**geometry)) as src, \
            KVCacheManager(KVCacheConfig(**geometry, kv_codec="int8")) as dst:
        serve(src, [1, 2], [0, 3], [10, 7])
        assert copy_users(src, dst, [1, 2, 3]) == 17  # user 3 holds nothing
        assert [(v.start_pos, v.length) for v in dst.get_user_versions([1, 2, 3])] == [(0, 10), (3, 7), (0, 0)]
        assert dst.get_user_tags([1, 2]) == src.get_user_tags([1, 2])
        assert dst.stats().users_on_device == 0 and dst.stats().users_on_host == 2
        for u in (1, 2):
            assert torch.equal(dst.read_times(u), src.read_times(u))
            for held, copied in zip(src.read_kv(u, 1), dst.read_kv(u, 1)):  # K, then V: int8 of them
                assert 0 < float((copied - held).abs().max()) < 0.05 * float(held.abs().max())


@pytest.mark.parametrize("codec", ["bf16", "zstd", "raw"])  # raw's encoding views the staging buffer
def test_memory_tier_keeps_write_parts_and_merges_them(codec):
    """Every incremental write adds an encoded part; past MAX_PARTS they are merged. Reads (whole, or
    any page range the pool asks for) decode to what was written, across parts and merges."""
    from kvcache.storage.encoded_memory_tier import MAX_PARTS

    tier = _tier("memory", codec, None)
    held, length = _pages(0, 0), 0
    for visit in range(MAX_PARTS + 4):
        first = length // LAYOUT.page_size
        length += 3
        pages = _pages(LAYOUT.num_pages(length) - first, visit)
        assert tier.write(7, 0, length, first, lambda dst, p=pages: dst.copy_(p)).stored
        held = concat_pages([held[:first], pages])
        got = tier.read(7).pages
        want = _expected(codec, held)
        assert torch.equal(got.decode().kv, want.kv) and torch.equal(got.decode().times, held.times)
        n = got.num_pages
        for start, stop in {(0, n), (n // 3, n), (min(1, n - 1), n - 1)}:
            out = empty_pages(LAYOUT, stop - start)
            got.page_range(start, stop).decode_into(out)
            assert torch.equal(out.kv, want.kv[start:stop]) and torch.equal(out.times, held.times[start:stop])
        assert len(tier._users.get(7).parts) <= MAX_PARTS
