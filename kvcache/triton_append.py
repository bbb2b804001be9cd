"""`append_kvcache` on CUDA: the new K and V rows of a whole batch written into their slots in one
Triton launch (grid: token x chunk of its H*D elements).

A token's row in the pool viewed as [num_pages * page_size, H * D] is its slot; the new K/V may be
strided views (rows of a wider projection) as long as each row's H*D elements are contiguous.
Without CUDA the tests run it through Triton's interpreter on CPU tensors.
"""
from __future__ import annotations

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 1024  # elements of a row per program
NUM_WARPS = 4


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _append_kernel(K_CACHE, V_CACHE, NEW_K, NEW_V, SLOTS, row_elems, stride_k, stride_v, BLOCK_E: tl.constexpr):
        token, chunk = tl.program_id(0), tl.program_id(1)
        slot = tl.load(SLOTS + token).to(tl.int64)
        offs = chunk * BLOCK_E + tl.arange(0, BLOCK_E)
        inside = offs < row_elems
        k = tl.load(NEW_K + token.to(tl.int64) * stride_k + offs, mask=inside)
        tl.store(K_CACHE + slot * row_elems + offs, k, mask=inside)
        v = tl.load(NEW_V + token.to(tl.int64) * stride_v + offs, mask=inside)
        tl.store(V_CACHE + slot * row_elems + offs, v, mask=inside)


def append_rows(k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor, slots: Tensor) -> None:
    """k_cache/v_cache [num_pages, page_size, H, D] (contiguous); new_k/new_v [N, H, D] with contiguous rows."""
    n, heads, dim = new_k.shape
    if n == 0:
        return
    for name, t in (("new_k", new_k), ("new_v", new_v)):
        if t.stride(2) != 1 or t.stride(1) != dim:
            raise ValueError(f"{name} rows must be contiguous H*D elements, got strides {tuple(t.stride())}")
    row_elems = heads * dim
    grid = (n, triton.cdiv(row_elems, BLOCK))
    _append_kernel[grid](k_cache, v_cache, new_k, new_v, slots, row_elems, new_k.stride(0), new_v.stride(0),
                         BLOCK_E=BLOCK, num_warps=NUM_WARPS)
