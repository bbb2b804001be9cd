"""kvcache.codecs.sparse: which tokens a page keeps, kept tokens decoded in their own slots with their
times, dropped ones decoded as zero K/V, the recent pages of a write kept whole, the stated bound,
and a manager serving a sparsified user: same window, same lengths, appends continuing it."""
import pytest
import torch

from kvcache import KVCacheConfig, KVCacheManager, PageLayout
from kvcache.codecs import CodecSpecError, get_codec
from kvcache.codecs.sparse import kept_slots
from kvcache.page_data import PageData, empty_pages

LAYOUT = PageLayout(num_layers=2, num_heads=2, head_dim=4, page_size=8, dtype=torch.float32)


def _pages(n, seed=0, layout=LAYOUT):
    g = torch.Generator().manual_seed(seed)
    pages = empty_pages(layout, n)
    pages.kv.copy_(torch.randn(pages.kv.shape, generator=g) * 0.1)
    pages.times.copy_(torch.randint(0, 1 << 40, pages.times.shape, generator=g))
    return pages


def _round_trip(spec, pages, layout=LAYOUT):
    codec = get_codec(spec)
    return codec.decode(layout, codec.encode(layout, pages))


def test_specs_are_canonical_and_checked():
    assert get_codec("sparse").spec == "sparse:keep=50,merge=1,recent=1,score=vnorm,values=raw"
    assert get_codec("sparse:values=int8,keep=10,merge=1").spec == "sparse:keep=10,merge=1,recent=1,score=vnorm,values=int8"
    for bad, problem in [("sparse:keep=0", "keep must be in"), ("sparse:score=h2o", "score must be one of"),
                         ("sparse:values=zstd", "values must be one of"), ("sparse:recent=-1", "recent must be in"),
                         ("sparse:recent=0", "recent >= 1")]:
        with pytest.raises(CodecSpecError, match=problem):
            get_codec(bad)


@pytest.mark.parametrize("score, part", [("vnorm", 1), ("knorm", 0)])
def test_a_page_keeps_its_highest_scoring_tokens_in_their_slots(score, part):
    pages = _pages(3)
    heavy = torch.tensor([[1, 6], [0, 7], [3, 4]])  # two heavy tokens per page (keep=25% of 8)
    for page, slots in enumerate(heavy):
        pages.kv[page, :, part, slots] *= 100
    decoded = _round_trip(f"sparse:keep=25,merge=0,recent=0,score={score}", pages)
    kept = decoded.kv.flatten(4).abs().sum(dim=(1, 2, 4)) > 0  # [pages, slots]: anything decoded there
    expected = torch.zeros(3, 8, dtype=torch.bool).scatter_(1, heavy, True)
    assert torch.equal(kept, expected)
    rows = torch.arange(3)[:, None]
    assert torch.equal(decoded.kv[rows, :, :, heavy], pages.kv[rows, :, :, heavy])  # exact, same slot
    assert torch.equal(decoded.times, pages.times)  # every token's time, dropped ones too


def test_stride_keeps_evenly_spaced_slots_and_recent_pages_whole():
    pages = _pages(4)
    decoded = _round_trip("sparse:keep=50,merge=0,recent=2,score=stride", pages)
    assert torch.equal(decoded.kv[2:], pages.kv[2:])  # the write's last two pages: whole
    kept = decoded.kv[:2].flatten(4).abs().sum(dim=(0, 1, 2, 4)) > 0
    assert kept.nonzero().view(-1).tolist() == [0, 2, 5, 7]  # round(linspace(0, 7, 4))
    assert torch.equal(kept_slots(pages.kv, "stride", 4)[0], torch.tensor([0, 2, 5, 7]))


def test_kvnorm_ranks_by_the_product_and_full_keep_is_exact():
    pages = _pages(1)
    pages.kv[0, :, 0, 2] *= 50  # large K only
    pages.kv[0, :, 1, 5] *= 50  # large V only
    pages.kv[0, :, :, 3] *= 20  # both large
    assert kept_slots(pages.kv, "kvnorm", 1).tolist() == [[3]]
    assert kept_slots(pages.kv, "vnorm", 1).tolist() == [[5]]
    decoded = _round_trip("sparse:keep=100,recent=0", pages)
    assert torch.equal(decoded.kv, pages.kv)


@pytest.mark.parametrize("spec", ["sparse:keep=20", "sparse:keep=50,values=int8,score=kvnorm",
                                  "sparse:keep=20,merge=1,values=int8", "sparse:keep=10,merge=0,values=bf16,recent=0"])
def test_error_within_bound_and_bytes_shrink(spec):
    pages = _pages(6, seed=4)
    codec = get_codec(spec)
    encoded = codec.encode(LAYOUT, pages)
    decoded = codec.decode(LAYOUT, encoded)
    assert ((decoded.kv - pages.kv).abs() <= codec.max_abs_error(LAYOUT, pages)).all()
    assert encoded.nbytes < 6 * LAYOUT.page_nbytes


def test_corrupt_rows_are_refused():
    codec = get_codec("sparse:keep=25,merge=0,recent=0")
    encoded = codec.encode(LAYOUT, _pages(2))
    bad = encoded.data.clone()
    bad[:8].view(torch.int64).fill_(99)  # a page claiming 99 kept tokens
    with pytest.raises(ValueError, match="cannot keep 99"):
        codec.decode(LAYOUT, type(encoded)(encoded.spec, bad, encoded.offsets))


def test_manager_serves_a_sparsified_user_with_its_window_and_appends_after_it():
    config = KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, page_size=8, num_pages=16,
                           kv_codec="sparse:keep=25,merge=0,recent=1")
    with KVCacheManager(config) as cache:
        length = 36  # 4 full pages and a partial one
        g = torch.Generator().manual_seed(1)
        kv = torch.randn(2, 2, length, 2, 4, generator=g)  # [layers, K/V, tokens, H, D]
        times = torch.arange(length) * 1000 + 7
        _commit(cache, 5, 0, kv, times)
        cache.offload_kv_cache([5])
        cache.evict_kv_cache([5])
        start, cached = cache.get_user_kvdata_info([5])
        assert (start.item(), cached.item()) == (0, length)  # the window is unchanged
        _commit(cache, 5, length, torch.randn(2, 2, 3, 2, 4, generator=g), torch.arange(3) + 10**6)
        k0, v0 = cache.read_kv(5, 0)
        assert k0.shape[0] == length + 3 and torch.equal(cache.read_times(5)[:length], times)
        held = v0[:32].flatten(1).abs().sum(1) > 0  # sparse pages: 2 of 8 tokens each
        assert held.view(4, 8).sum(1).tolist() == [2, 2, 2, 2]
        assert torch.equal(v0[32:length], kv[0, 1, 32:])  # the recent (partial) page: whole
        slots = held.nonzero().view(-1)
        assert torch.equal(v0[slots], kv[0, 1, slots]) and torch.equal(k0[slots], kv[0, 0, slots])


def _commit(cache, user, start, kv, times):
    """Prepare, write the tokens' K/V and times straight into their slots, commit."""
    n = kv.shape[2]
    meta = cache.prepare_kv_cache([user], [start], [n])
    slots = meta.new_token_slots
    for layer in range(kv.shape[0]):
        cache.k_cache(layer).view(-1, 2, 4)[slots] = kv[layer, 0]
        cache.v_cache(layer).view(-1, 2, 4)[slots] = kv[layer, 1]
    cache.times_cache().view(-1)[slots] = times
    cache.commit(meta)


def test_page_data_is_untouched_by_encoding():
    pages = _pages(2)
    before = PageData(pages.kv.clone(), pages.times.clone())
    get_codec("sparse:keep=25,values=int8").encode(LAYOUT, pages)
    assert torch.equal(pages.kv, before.kv) and torch.equal(pages.times, before.times)


def test_merge_folds_the_dropped_tokens_into_one_stored_token():
    """merge=1: the page stores its top tokens and, at the middle dropped slot, the dropped tokens' mean K
    and summed V; every other dropped slot decodes as zero."""
    pages = _pages(2)  # page 1, the write's last, is kept whole
    pages.kv[0, :, 1, 6] *= 100  # slot 6 is the top |V| token
    decoded = _round_trip("sparse:keep=1,merge=1,recent=1", pages)  # keeps 1 of 8, merges 7
    dropped = [0, 1, 2, 3, 4, 5, 7]
    assert torch.equal(decoded.kv[0, :, :, 6], pages.kv[0, :, :, 6])
    merged = decoded.kv[0, :, :, 3]  # the middle of the dropped slots
    assert torch.allclose(merged[:, 0], pages.kv[0, :, 0, dropped].mean(dim=1), atol=1e-6)
    assert torch.allclose(merged[:, 1], pages.kv[0, :, 1, dropped].sum(dim=1), atol=1e-6)
    others = [0, 1, 2, 4, 5, 7]
    assert not decoded.kv[0, :, :, others].any()
    codec = get_codec("sparse:keep=1,merge=1,recent=1")
    assert ((decoded.kv - pages.kv).abs() <= codec.max_abs_error(LAYOUT, pages)).all()


def test_merge_into_runs_of_dropped_slots():
    """merge=2: the 7 dropped slots [0, 1, 2, 3, 4, 5, 7] form runs [0..3] and [4, 5, 7], each folded into
    its middle slot (1 and 5)."""
    pages = _pages(2, seed=2)
    pages.kv[0, :, 1, 6] *= 100
    decoded = _round_trip("sparse:keep=1,merge=2,recent=1", pages)
    for run, slot in [([0, 1, 2, 3], 1), ([4, 5, 7], 5)]:
        assert torch.allclose(decoded.kv[0, :, 0, slot], pages.kv[0, :, 0, run].mean(dim=1), atol=1e-6)
        assert torch.allclose(decoded.kv[0, :, 1, slot], pages.kv[0, :, 1, run].sum(dim=1), atol=1e-6)
    assert not decoded.kv[0, :, :, [0, 2, 3, 4, 7]].any()
    assert get_codec("sparse:keep=1,merge=2,recent=1").encode(LAYOUT, pages).sizes()[0] < LAYOUT.page_nbytes / 2
