"""kvcache.codecs: specs, exact round trips of the lossless codecs, the stated error bound of the
lossy ones on random pages, times kept bit-exact, bad input refused."""
import numpy as np
import pytest
import torch
import zstandard

from helpers import host_pages, pages_equal
from kvcache import PageLayout
from kvcache.codecs import CodecSpecError, EncodedPages, codec_names, get_codec
from kvcache.page_data import PageData, empty_pages

LAYOUT = PageLayout(num_layers=3, num_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
LOSSLESS = ["raw", "zstd", "zstd:shuffle=0", "zstd:level=1", "zstd-channel"]
LOSSY = ["bf16", "fp16", "int8", "int8:mode=affine", "int8:group=token", "mixed", "mixed:deep=int8token",
         "mixed:shallow=raw,shallow_layers=2,deep=int8affine",
         "sparse:keep=50,values=int8", "zstd:values=bf16", "zstd:values=fp16,shuffle=0"]


def _normal_pages(n, seed, scale=1.0, layout=LAYOUT):
    g = torch.Generator().manual_seed(seed)
    pages = empty_pages(layout, n)
    pages.kv.copy_(torch.randn(pages.kv.shape, generator=g) * scale)
    pages.times.copy_(torch.randint(-1, 1 << 62, pages.times.shape, generator=g))
    return pages


def test_names_and_canonical_specs():
    assert codec_names() == ["bf16", "fp16", "int8", "mixed", "raw", "sparse", "zstd", "zstd-channel"]
    assert get_codec("zstd").spec == "zstd:level=3,shuffle=1"  # what tiers stored before `values` existed
    assert get_codec("zstd:values=raw").spec == "zstd:level=3,shuffle=1"
    assert get_codec("zstd:values=bf16").spec == "zstd:level=3,shuffle=1,values=bf16"
    assert get_codec("int8").spec == "int8:mode=sym"
    assert get_codec("int8:group=page,mode=affine").spec == "int8:mode=affine"  # what tiers stored before `group`
    assert get_codec("int8:group=token").spec == "int8:group=token"
    assert get_codec("mixed:deep=int8,shallow_layers=2").spec == "mixed:deep=int8,shallow=bf16,shallow_layers=2"
    for name in codec_names():  # a canonical spec names the same codec again
        spec = get_codec(name).spec
        assert get_codec(spec).spec == spec


@pytest.mark.parametrize("spec, problem", [
    ("lz9", "Unknown KV codec 'lz9'"), ("", "non-empty"), ("int8:mode", "not key=value"),
    ("int8:mode=cubic", "mode must be one of"), ("zstd:level=99", "level must be in [1, 19]"),
    ("bf16:level=3", "takes parameters none"), ("int8:mode=sym,mode=affine", "given twice"),
    ("int8:group=token,mode=sym", "int8:group=token is affine"), ("int8:group=head", "group must be one of"),
    ("mixed:deep=int4", "deep must be one of"), ("zstd:values=int8", "values must be one of"),
])
def test_bad_specs_are_refused_by_name(spec, problem):
    with pytest.raises(CodecSpecError, match=problem.replace("[", r"\[").replace("]", r"\]")):
        get_codec(spec)


@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_codecs_are_bit_exact_on_any_bits(spec):
    pages = host_pages(LAYOUT, 5, seed=3)  # random bits: NaNs and infs included
    codec = get_codec(spec)
    decoded = codec.decode(LAYOUT, codec.encode(LAYOUT, pages))
    assert codec.lossless and pages_equal(decoded, pages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_codecs_stay_within_their_bound_and_keep_times(spec, dtype):
    layout = PageLayout(3, 2, 8, 4, dtype)
    codec = get_codec(spec)
    for seed, scale in [(0, 1.0), (1, 1e-3), (2, 300.0)]:
        pages = _normal_pages(6, seed, scale, layout)
        pages.kv[1, 0, 0, :, 1] = 0.0  # a constant group
        encoded = codec.encode(layout, pages)
        decoded = codec.decode(layout, encoded)
        assert torch.equal(decoded.times, pages.times)
        assert decoded.kv.dtype == dtype
        err = (decoded.kv.float() - pages.kv.float()).abs()
        bound = codec.max_abs_error(layout, pages)
        assert bool((err <= bound).all()), f"{spec}: error {float((err - bound).max())} past the bound"
        assert float(err.max()) > 0 or dtype == torch.bfloat16


def test_bound_is_tight_enough_to_mean_something():
    """int8's bound is half a step of the group's range: ~|x|max / 254, not a loose constant."""
    pages = _normal_pages(4, 0)
    codec = get_codec("int8")
    bound = codec.max_abs_error(LAYOUT, pages)
    amax = pages.kv.abs().amax(dim=(3, 5), keepdim=True)
    assert bool((bound <= amax / 254 * 1.001 + 1e-6).all())


def test_sizes_of_fp32_pages():
    """bf16 halves fp32 K/V, int8 takes a quarter plus its scales; times add 8 bytes a token to each."""
    layout = PageLayout(3, 4, 128, 32, torch.float32)  # the kuairand-1k preset geometry
    pages = _normal_pages(2, 0, layout=layout)
    raw = layout.page_nbytes
    ratio = {s: raw / get_codec(s).encode(layout, pages).sizes()[0] for s in ["bf16", "int8", "int8:group=token", "mixed"]}
    assert 1.99 < ratio["bf16"] <= 2.0
    assert 3.9 < ratio["int8"] < 4.0
    assert 3.7 < ratio["int8:group=token"] < 3.8  # 8 bytes of scale and minimum per 128 codes
    assert ratio["bf16"] < ratio["mixed"] < ratio["int8"]


@pytest.mark.parametrize("spec", ["int8", "int8:group=token"])
def test_int8_refuses_non_finite_pages_by_name(spec):
    pages = _normal_pages(2, 0)
    pages.kv[1, 2, 1, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite K/V"):
        get_codec(spec).encode(LAYOUT, pages)


def test_decode_refuses_another_codecs_pages():
    pages = _normal_pages(2, 0)
    encoded = get_codec("bf16").encode(LAYOUT, pages)
    with pytest.raises(ValueError, match="encoded with codec 'bf16' cannot be decoded by 'int8:mode=sym'"):
        get_codec("int8").decode(LAYOUT, encoded)
    wrong = EncodedPages("zstd:level=3,shuffle=1", encoded.data, encoded.offsets)  # mislabelled bytes
    with pytest.raises(Exception):  # noqa: B017 (zstd's own error for bytes that are no frame)
        get_codec("zstd").decode(LAYOUT, wrong)


def test_encoding_strided_pages_equals_encoding_dense_ones():
    """Tiers hand out layer-major views; a codec must read them as the pages they are."""
    dense = _normal_pages(3, 5)
    strided_kv = dense.kv.transpose(0, 1).contiguous().transpose(0, 1)
    strided = PageData(strided_kv, dense.times.clone())
    for spec in ["zstd", "int8", "mixed"]:
        codec = get_codec(spec)
        a, b = codec.encode(LAYOUT, dense), codec.encode(LAYOUT, strided)
        assert torch.equal(a.data, b.data)


@pytest.mark.parametrize("chunk_pages", [None, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_strided_output_equals_decode(dtype, chunk_pages, monkeypatch):
    """Fixed-width codecs decode each run of layers straight into the output pages (no temporary; int8
    in steps of `chunk_pages` pages, the last one short): bit-identical to the value codec's own decode."""
    from kvcache.codecs import int8
    from kvcache.codecs.int8 import Int8Values
    from kvcache.codecs.int8_rows import Int8RowValues
    from kvcache.codecs.values import CastValues

    layout = PageLayout(3, 2, 8, 4, dtype)
    kv = _normal_pages(3, 7, layout=layout).kv
    if chunk_pages is not None:  # a page of 2 layers' output: 2 * 2 * 4 * 2 * 8 float32
        monkeypatch.setattr(int8, "_DECODE_CHUNK_NBYTES", chunk_pages * 2 * 2 * 4 * 2 * 8 * 4)
    for values in [Int8Values(affine=False), Int8Values(affine=True), Int8RowValues(), CastValues("bf16", torch.bfloat16)]:
        rows = torch.empty((3, values.width(layout, 2)), dtype=torch.uint8)
        values.encode_into(layout, kv[:, 1:], rows)
        out = torch.full_like(kv, 7.0)
        values.decode_into(layout, rows, out[:, 1:])
        assert torch.equal(out[:, 1:], values.decode(layout, rows, 2)) and bool((out[:, 0] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zstd_on_a_cast_decodes_exactly_what_the_cast_decodes(dtype):
    """`zstd:values=bf16` is lossless on top of the cast: the same values as `bf16`, into any output."""
    layout = PageLayout(3, 2, 8, 4, dtype)
    pages = _normal_pages(5, 11, layout=layout)
    chained, cast = get_codec("zstd:values=bf16"), get_codec("bf16")
    want = cast.decode(layout, cast.encode(layout, pages))
    encoded = chained.encode(layout, pages)
    assert pages_equal(chained.decode(layout, encoded), want)
    out = PageData(torch.full_like(pages.kv.transpose(0, 1), 7.0).transpose(0, 1), torch.zeros_like(pages.times))
    chained.decode_into(layout, encoded, out)
    assert pages_equal(out, want) and not chained.lossless


def test_zstd_on_a_cast_takes_the_exponent_bytes_the_cast_keeps():
    """Normal values: the cast halves the bytes, and zstd then takes a good part of each value's
    sign-and-exponent byte, which it cannot do past fp32's 23 noisy mantissa bits as well."""
    layout = PageLayout(3, 4, 128, 32, torch.float32)
    pages = _normal_pages(2, 0, layout=layout)
    sizes = {s: int(get_codec(s).encode(layout, pages).sizes().sum()) for s in ["bf16", "zstd:values=bf16", "zstd"]}
    assert sizes["zstd:values=bf16"] < sizes["bf16"] / 1.25 and sizes["zstd:values=bf16"] < sizes["zstd"] / 2


def _channel_scaled_pages(n: int, seed: int, layout: PageLayout) -> PageData:
    """Pages whose channels (layer, K/V, head, dim) each have a scale and a sign of their own, as trained
    K/V do: log-uniform scales over 2^-8 .. 2^8, and 90% of a channel's values of its sign."""
    g = torch.Generator().manual_seed(seed)
    pages = empty_pages(layout, n)
    channel = (1, *layout.page_shape[:2], 1, *layout.page_shape[3:])
    scale = torch.exp2(torch.rand(channel, generator=g) * 16 - 8)
    sign = torch.where(torch.rand(channel, generator=g) < 0.5, -1.0, 1.0)
    flips = torch.where(torch.rand(pages.kv.shape, generator=g) < 0.1, -1.0, 1.0)
    pages.kv.copy_((torch.randn(pages.kv.shape, generator=g).abs() + 0.5) * scale * sign * flips)
    pages.times.copy_(torch.randint(0, 1 << 41, pages.times.shape, generator=g))
    return pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zstd_channel_is_exact_and_smaller_than_zstd_where_channels_differ(dtype):
    """`zstd-channel` codes each value's sign and exponent against its channel's: on pages whose channels differ in
    scale and sign it stores fewer bytes than byte-shuffled zstd, and decodes them bit for bit."""
    layout = PageLayout(3, 4, 16, 32, dtype)
    pages = _channel_scaled_pages(4, 0, layout)
    channel, zstd = get_codec("zstd-channel"), get_codec("zstd")
    encoded = channel.encode(layout, pages)
    assert pages_equal(channel.decode(layout, encoded), pages)
    assert encoded.nbytes < zstd.encode(layout, pages).nbytes / 1.05


def test_zstd_channel_round_trips_odd_channel_counts_and_one_page_at_a_time():
    """18 channels (the reference signs fill part of a byte); pages encoded together or apart decode alike."""
    layout = PageLayout(3, 1, 3, 5, torch.float32)
    pages, codec = host_pages(layout, 3, seed=4), get_codec("zstd-channel")
    together = codec.decode(layout, codec.encode(layout, pages))
    apart = [codec.decode(layout, codec.encode(layout, pages[i : i + 1])) for i in range(3)]
    assert pages_equal(together, pages)
    assert all(pages_equal(a, pages[i : i + 1]) for i, a in enumerate(apart))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zstd_channel_keeps_far_exponents_zeros_and_non_finite_values_bit_for_bit(dtype):
    """Exponents far from their channel's median (a code's escape, stored aside), signed zeros,
    subnormals, infinities and NaN payloads all come back as the same bits."""
    layout = PageLayout(2, 2, 8, 16, dtype)
    pages = _channel_scaled_pages(3, 5, layout)
    flat = pages.kv.view(-1)
    g = torch.Generator().manual_seed(9)
    picks = torch.randperm(flat.numel(), generator=g)[:400]
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-39, 3e38, 1e-30, 7e20])
    flat[picks] = specials.to(dtype).repeat(40)
    codec = get_codec("zstd-channel")
    decoded = codec.decode(layout, codec.encode(layout, pages))
    assert torch.equal(decoded.kv.contiguous().view(torch.uint8), pages.kv.contiguous().view(torch.uint8))
    assert torch.equal(decoded.times, pages.times)


@pytest.mark.parametrize("spec", ["zstd-channel", "zstd", "zstd:values=bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressing_codecs_store_pages_of_zero_bits_as_nothing_and_decode_them_exactly(spec, dtype):
    """Pages a read window zeroed (K/V and times): no bytes, wherever they sit among stored pages, decoded
    (also into strided output) to zeros; a page of -0.0 or with nonzero times is not zero bits."""
    layout = PageLayout(2, 2, 8, 4, dtype)
    pages = _channel_scaled_pages(7, 3, layout)
    for i in (1, 2, 5):
        pages.kv[i].zero_()
        pages.times[i].zero_()
    pages.kv[3].fill_(-0.0)
    pages.times[3].zero_()
    pages.kv[6].zero_()  # times kept: stored
    codec = get_codec(spec)
    encoded = codec.encode(layout, pages)
    sizes = encoded.sizes().tolist()
    assert [i for i, n in enumerate(sizes) if n == 0] == [1, 2, 5]
    if spec.endswith("bf16"):  # exact on top of the cast
        pages = codec.decode(layout, codec.encode(layout, pages))
    decoded = codec.decode(layout, encoded)
    assert torch.equal(decoded.kv.contiguous().view(torch.uint8), pages.kv.contiguous().view(torch.uint8))
    assert torch.equal(decoded.times, pages.times)
    out = PageData(torch.full((layout.num_layers, 7, *layout.page_shape[1:]), 7.0, dtype=dtype).transpose(0, 1),
                   torch.full((7, layout.page_size), 7))
    codec.decode_into(layout, encoded, out)  # the pool's layer-major pages
    assert pages_equal(out, pages)


def test_zstd_channel_refuses_other_dtypes_and_damaged_pages_by_name():
    codec = get_codec("zstd-channel")
    fp16 = PageLayout(3, 2, 8, 4, torch.float16)
    with pytest.raises(ValueError, match=r"float32 or bfloat16 K/V, not torch\.float16"):
        codec.encode(fp16, _normal_pages(1, 0, layout=fp16))
    encoded = codec.encode(LAYOUT, _normal_pages(2, 0))
    cut = EncodedPages(encoded.spec, encoded.data[:-1], encoded.offsets - [0, 0, 1])  # page 1 loses a byte
    with pytest.raises(ValueError, match=r"Codec zstd-channel: page 1 is not this codec's encoding"):
        codec.decode(LAYOUT, cut)


def test_zstd_channel_refuses_a_page_whose_far_exponents_do_not_match_its_codes():
    """A page whose header lost one of the exponents stored aside decodes to an error naming the page,
    not to values with a wrong exponent."""
    codec = get_codec("zstd-channel")
    pages = _normal_pages(2, 3)
    pages.kv[1, 0, 0, 0, 0, :3] = torch.tensor([1e-30, 1e30, 0.0])  # far from their channels' medians
    encoded = codec.encode(LAYOUT, pages)
    rows = encoded.rows()
    lengths = rows[1][:12].view("<u4").astype(np.int64)
    header = zstandard.ZstdDecompressor().decompress(rows[1][12 : 12 + lengths[0]].tobytes())
    shorter = np.frombuffer(zstandard.ZstdCompressor().compress(header[:-1]), np.uint8)
    rest = rows[1][12 + lengths[0] :]
    row = np.concatenate([np.array([len(shorter), *lengths[1:]], "<u4").view(np.uint8), shorter, rest])
    damaged = EncodedPages.from_rows(encoded.spec, [rows[0], row])
    assert pages_equal(codec.decode(LAYOUT, encoded), pages)
    with pytest.raises(ValueError, match=r"Codec zstd-channel: page 1 .*far exponents coded"):
        codec.decode(LAYOUT, damaged)


def test_zstd_refuses_damaged_pages_by_name():
    codec = get_codec("zstd")
    encoded = codec.encode(LAYOUT, _normal_pages(2, 0))
    cut = EncodedPages(encoded.spec, encoded.data[:-1], encoded.offsets - [0, 0, 1])  # page 1 loses a byte
    with pytest.raises(ValueError, match=r"Codec zstd:level=3,shuffle=1: page 1 does not decompress"):
        codec.decode(LAYOUT, cut)
    flipped = encoded.data.copy() if isinstance(encoded.data, np.ndarray) else encoded.data.clone()
    flipped[encoded.offsets[1] + 6] ^= 0xFF  # inside page 1's frame
    with pytest.raises(ValueError, match=r"Codec zstd:level=3,shuffle=1: page 1 "):
        codec.decode(LAYOUT, EncodedPages(encoded.spec, flipped, encoded.offsets))
