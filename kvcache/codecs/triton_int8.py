"""Int8 K/V decoded on CUDA straight into the device pool's pages: one Triton launch per run of layers.

Both int8 value codecs store `codes * scale + low` (`low` 0 when symmetric): `int8` with a scale
per page, layer, K-or-V and head, `int8:group=token` with one per token too. Seen as strided views,
`codes [k, l, 2, S, H, D]` and `scale`, `low [k, l, 2, S, H]` (a page-head scale broadcast over the
page's tokens with stride 0) describe both, so one kernel decodes either. Its grid is
(encoded page, layer x K/V, block of the page's S*H rows); each program reads its rows' codes and
scales once and writes the values once, in the pool's dtype, into the page the page id names. The
encoded bytes cross the bus (a quarter of fp32's), and nothing else is allocated or copied on the
device: no float temporary, no decoded pages, no scatter pass.

The value is `fma(q, scale, low)` in float32, rounded once, as `int8:group=token`'s torch decode
(`addcmul`); `int8`'s torch decode rounds the product first, so the two may differ by one float32
ulp, inside the codec's bound. Triton's interpreter rounds twice (it has no fused multiply-add); the
tests, run through it on CPU, check both against the torch decode.
"""
from __future__ import annotations

import os

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ROWS_PER_PROGRAM = 32  # S*H rows (tokens x heads) of one page's layer and K/V
NUM_WARPS = 4
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


def applies(t: Tensor) -> bool:
    """Whether the kernel decodes tensors where `t` lives: on CUDA, or on CPU under Triton's interpreter."""
    return triton is not None and (t.is_cuda or (_INTERPRETED and t.device.type == "cpu"))


if triton is not None:

    @triton.jit
    def _decode_kernel(OUT, PAGE_IDS, CODES, SCALE, LOW,
                       o_l, o_p, o_page, o_s, o_h,
                       c_k, c_l, c_p, c_s, c_h,
                       s_k, s_l, s_p, s_s, s_h,
                       rows_per_page, heads, head_dim,
                       HAS_LOW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        page, layer_part, block = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        layer, part = (layer_part // 2).to(tl.int64), (layer_part % 2).to(tl.int64)
        dst_page = tl.load(PAGE_IDS + page).to(tl.int64)
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
        s, h = (rows // heads).to(tl.int64), (rows % heads).to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        row_in = rows < rows_per_page
        mask = row_in[:, None] & (dims < head_dim)[None, :]

        at_scale = page * s_k + layer * s_l + part * s_p + s * s_s + h * s_h  # [BLOCK_R]
        scale = tl.load(SCALE + at_scale, mask=row_in, other=0.0)
        low = tl.load(LOW + at_scale, mask=row_in, other=0.0) if HAS_LOW else tl.zeros_like(scale)
        at_codes = (page * c_k + layer * c_l + part * c_p + s * c_s + h * c_h)[:, None] + dims[None, :]
        q = tl.load(CODES + at_codes, mask=mask, other=0).to(tl.float32)
        x = tl.fma(q, scale[:, None], low[:, None])
        at_out = (layer * o_l + part * o_p + dst_page * o_page + s * o_s + h * o_h)[:, None] + dims[None, :]
        tl.store(OUT + at_out, x.to(OUT.dtype.element_ty), mask=mask)


def block_dims(head_dim: int) -> int:
    """The head dims a program covers (a power of two, masked to head_dim)."""
    return triton.next_power_of_2(head_dim)


def decode_into_pages(out: Tensor, page_ids: Tensor, codes: Tensor, scale: Tensor, low: Tensor | None) -> None:
    """out[:, :, page_ids[i]] <- codes[i] * scale[i] + low[i] for each encoded page i, every layer and K/V.

    out [l, 2, P, S, H, D] (the pool's pages of a run of layers, any strides with dense head dims);
    page_ids [k] int64 on out's device; codes [k, l, 2, S, H, D] int8 or uint8 and scale, low
    [k, l, 2, S, H] float32 (views of the encoded rows, any strides, dense head dims); low None: 0.
    """
    k, num_layers, _, page_size, heads, head_dim = codes.shape
    if k == 0:
        return
    if out.shape[0] != num_layers or out.shape[3:] != codes.shape[3:]:
        raise ValueError(f"int8 decode: pages {tuple(out.shape)} do not take codes {tuple(codes.shape)}")
    for name, t in (("out", out), ("codes", codes)):
        if t.stride(-1) != 1:
            raise ValueError(f"int8 decode: {name}'s head dims must be dense, got strides {tuple(t.stride())}")
    rows_per_page = page_size * heads
    grid = (k, num_layers * 2, triton.cdiv(rows_per_page, ROWS_PER_PROGRAM))
    low_or_scale = scale if low is None else low
    if low is not None and low.stride() != scale.stride():
        raise ValueError(f"int8 decode: scale and low strides differ ({scale.stride()} vs {low.stride()})")
    _decode_kernel[grid](
        out, page_ids, codes, scale, low_or_scale,
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), out.stride(4),
        *codes.stride()[:5], *scale.stride(),
        rows_per_page, heads, head_dim,
        HAS_LOW=low is not None, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_D=block_dims(head_dim),
        num_warps=NUM_WARPS,
    )

