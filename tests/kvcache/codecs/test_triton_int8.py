"""The Triton int8 decode writes what the torch decode writes, into the pages the page ids name and no
others (CPU: Triton's interpreter, tests/conftest.py; CUDA: the compiled kernel)."""
from __future__ import annotations

import pytest
import torch

from kvcache import PageLayout
from kvcache.codecs import get_codec
from kvcache.codecs.triton_int8 import applies, decode_into_pages
from kvcache.page_data import empty_pages

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if not applies(torch.empty(0, device=DEVICE)):
    pytest.skip("triton is not installed", allow_module_level=True)


def _reference(pool: torch.Tensor, page_ids, codes, scale, low) -> torch.Tensor:
    """The decode in torch ops, rounded as the interpreter rounds (the product, then the sum)."""
    x = codes.float() * scale[..., None]
    if low is not None:
        x = x + low[..., None]
    out = pool.clone()
    out.index_copy_(2, page_ids, x.to(pool.dtype).permute(1, 2, 0, 3, 4, 5))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("page_size, heads, head_dim", [(1, 1, 4), (4, 2, 12), (16, 3, 16)])
def test_kernel_writes_the_decoded_pages_at_their_ids(dtype, affine, page_size, heads, head_dim):
    """Codes inside wider rows (the fused row format's strides), head_dim not a power of two, and pages of
    more rows than a program takes; every page the ids do not name keeps its bytes."""
    g = torch.Generator().manual_seed(page_size * heads + head_dim)
    k, layers, pool_pages = 5, 2, 9
    fused = torch.randint(0, 256, (k, layers, 2, page_size, heads, head_dim + 8), dtype=torch.uint8, generator=g)
    codes = fused[..., :head_dim] if affine else fused[..., :head_dim].view(torch.int8)
    scale = torch.rand(k, layers, 2, page_size, heads, generator=g) + 0.01
    low = torch.randn(k, layers, 2, page_size, heads, generator=g) if affine else None
    pool = torch.randn(layers, 2, pool_pages, page_size, heads, head_dim, generator=g).to(dtype)
    page_ids = torch.tensor([7, 2, 3, 0, 8])
    want = _reference(pool, page_ids, codes, scale, low)
    got = pool.to(DEVICE)
    decode_into_pages(got, page_ids.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None if low is None else low.to(DEVICE))
    if DEVICE == "cpu" and dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # CUDA rounds q * scale + low once, the interpreter's bf16 cast truncates: within one ulp
        torch.testing.assert_close(got.cpu(), want, rtol=torch.finfo(dtype).eps, atol=0)
    untouched = [1, 4, 5, 6]
    assert torch.equal(got.cpu()[:, :, untouched], pool[:, :, untouched])


def test_a_page_head_scale_broadcast_over_tokens_with_stride_0():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (3, 1, 2, 8, 2, 4), dtype=torch.int8, generator=g)
    per_head = torch.rand(3, 1, 2, 2, generator=g)
    scale = per_head[:, :, :, None, :].expand(3, 1, 2, 8, 2)
    pool = torch.zeros(1, 2, 4, 8, 2, 4)
    page_ids = torch.tensor([1, 3, 0])
    want = _reference(pool, page_ids, codes, scale, None)
    got = pool.to(DEVICE)
    decode_into_pages(got, page_ids.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), None)
    assert torch.equal(got.cpu(), want)


def test_shapes_that_do_not_fit_are_refused_by_name():
    codes = torch.zeros(2, 1, 2, 4, 2, 8, dtype=torch.uint8, device=DEVICE)
    scale = torch.ones(2, 1, 2, 4, 2, device=DEVICE)
    ids = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="do not take codes"):
        decode_into_pages(torch.zeros(1, 2, 3, 4, 2, 16, device=DEVICE), ids, codes, scale, None)
    with pytest.raises(ValueError, match="out's head dims must be dense"):
        decode_into_pages(torch.zeros(1, 2, 3, 4, 8, 2, device=DEVICE).transpose(4, 5), ids, codes, scale, None)


@pytest.mark.parametrize("spec", ["int8", "int8:mode=affine", "int8:group=token", "mixed", "bf16", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_decode_to_pages_is_the_decode_scattered(spec, dtype):
    """What the CUDA pool runs: the times bit-exact, int8 runs of layers through the kernel (the other
    layers and codecs by their torch decode), equal to `decode` up to the one rounding an interpreted
    fused multiply-add splits in two."""
    layout = PageLayout(num_layers=3, num_heads=2, head_dim=8, page_size=4, dtype=dtype)
    g = torch.Generator().manual_seed(len(spec))
    pages = empty_pages(layout, 5)
    pages.kv.copy_(torch.randn(pages.kv.shape, generator=g) * 3)
    pages.times.copy_(torch.randint(0, 1 << 40, pages.times.shape, generator=g))
    codec = get_codec(spec)
    encoded = codec.encode(layout, pages)
    want = codec.decode(layout, encoded)
    kv = torch.zeros(3, 2, 8, 4, 2, 8, dtype=dtype, device=DEVICE)
    times = torch.zeros(8, 4, dtype=torch.int64, device=DEVICE)
    page_ids = torch.tensor([6, 0, 3, 2, 7])
    on_device = encoded.to(torch.device(DEVICE)) if codec.decodes_on_device else encoded
    codec.decode_to_pages(layout, on_device, kv, times, page_ids.to(DEVICE))
    assert torch.equal(times.cpu()[page_ids], want.times)
    got = kv.cpu()[:, :, page_ids].permute(2, 0, 1, 3, 4, 5)
    torch.testing.assert_close(got, want.kv, rtol=torch.finfo(dtype).eps, atol=1e-6)
    untouched = [1, 4, 5]
    assert not kv.cpu()[:, :, untouched].any() and not times.cpu()[untouched].any()
