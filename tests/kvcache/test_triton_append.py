"""The Triton append kernel writes exactly what the reference append writes (CPU: Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

from kvcache import paged_kvcache_ops, triton_append

if not triton_append.available():
    pytest.skip("triton is not installed", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: Triton's interpreter (tests/conftest.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size, heads, dim", [(1, 1, 4), (4, 2, 8), (16, 3, 16)])
def test_append_kernel_matches_index_copy(dtype, page_size, heads, dim):
    g = torch.Generator().manual_seed(page_size)
    pages = 9
    cache = torch.randn(2, pages, page_size, heads, dim, generator=g).to(dtype).to(DEVICE)
    expected = cache.clone()
    n = 7
    slots = torch.randperm(pages * page_size, generator=g)[:n].to(DEVICE)
    wide = torch.randn(n, 4 * heads * dim, generator=g).to(dtype).to(DEVICE)  # rows of a wider projection
    new_k = wide[:, : heads * dim].reshape(n, heads, dim)  # strided views, as the layer hands them over
    new_v = wide[:, heads * dim : 2 * heads * dim].reshape(n, heads, dim)
    triton_append.append_rows(cache[0], cache[1], new_k, new_v, slots)
    expected[0].view(-1, heads, dim).index_copy_(0, slots, new_k)
    expected[1].view(-1, heads, dim).index_copy_(0, slots, new_v)
    assert torch.equal(cache, expected)


def test_rows_must_be_contiguous():
    cache = torch.zeros(2, 4, 4, 2, 8, device=DEVICE)
    transposed = torch.zeros(3, 8, 2, device=DEVICE).transpose(1, 2)  # [3, 2, 8] with non-contiguous rows
    with pytest.raises(ValueError, match="contiguous"):
        triton_append.append_rows(cache[0], cache[1], transposed, transposed, torch.arange(3, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_op_is_the_kernel():
    cache = torch.zeros(2, 4, 4, 2, 8, device="cuda")
    new = torch.randn(3, 2, 8, device="cuda")
    slots = torch.tensor([5, 0, 9], device="cuda")
    paged_kvcache_ops.append_kvcache(cache[0], cache[1], new, new, slots)
    assert torch.equal(cache[0].view(-1, 2, 8)[slots], new)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, dim", [(8, 160), (3, 400), (1, 1031), (4, 128)])
def test_wide_and_odd_rows_with_duplicate_padding_slots(dtype, heads, dim):
    """Rows wider than one program's BLOCK elements (and not a multiple of it) go to their slots whole; the
    padding rows of a bucketed batch all write the sink slot, which ends up holding, element by element,
    one of them, and no other slot is touched."""
    g = torch.Generator().manual_seed(heads * dim)
    pages, page_size, real, padding = 6, 32, 9, 5
    cache = torch.randn(2, pages, page_size, heads, dim, generator=g).to(dtype).to(DEVICE)
    expected = cache.clone()
    sink = pages * page_size - 1
    real_slots = torch.randperm(sink, generator=g)[:real]
    slots = torch.cat([real_slots, torch.full((padding,), sink)]).to(DEVICE)
    wide = torch.randn(real + padding, 3 * heads * dim + 7, generator=g).to(dtype).to(DEVICE)  # odd row stride
    new_k = wide[:, : heads * dim].reshape(-1, heads, dim)
    new_v = wide[:, heads * dim : 2 * heads * dim].reshape(-1, heads, dim)
    triton_append.append_rows(cache[0], cache[1], new_k, new_v, slots)
    for layer, new in ((0, new_k), (1, new_v)):
        rows, want = cache[layer].view(-1, heads, dim), expected[layer].view(-1, heads, dim)
        want.index_copy_(0, slots[:real], new[:real])
        untouched = torch.ones(len(rows), dtype=torch.bool)
        untouched[sink] = False
        assert torch.equal(rows[untouched.to(DEVICE)], want[untouched.to(DEVICE)])
        assert ((rows[sink][None] == new[real:]).any(0)).all()  # every element from some padding row
