"""Int8 K/V: one scale per page, layer, K-or-V and head (KIVI-style groups of page_size x head_dim values).

Symmetric: `q = round(x / s)` in [-127, 127], `s = max|x| / 127`; decoded `q * s`.
Affine: `q = round((x - lo) / s)` in [0, 255], `s = (max - lo) / 255`, `lo = min x`; decoded `q * s + lo`
(spends the 8 bits on the group's range, for groups that are not centred on 0).
Either way |error| <= s / 2 per element (plus float32 rounding), the bound `max_abs_error` states.
Scales are float32 (4 or 8 bytes per group: 0.8% of an int8 page for head_dim 64).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..page_layout import PageLayout
from .values import ValueCodec, aligned, cast_error, layer_shape

_GROUP_DIMS = (3, 5)  # [k, l, 2, S, H, D]: a group spans the page's tokens and a head's dims
# Decoded bytes per step of a host decode, so that its second pass reads the first's output from
# cache (docs/benchmarks.md, "int8 onload in cache-sized steps").
_DECODE_CHUNK_NBYTES = 4 << 20


class Int8Values(ValueCodec):
    def __init__(self, affine: bool) -> None:
        self.affine = affine
        self.name = "int8affine" if affine else "int8"

    def _params_nbytes(self, layout: PageLayout, num_layers: int) -> int:
        groups = num_layers * 2 * layout.num_heads
        return aligned(groups * 4 * (2 if self.affine else 1))

    def width(self, layout: PageLayout, num_layers: int) -> int:
        codes = num_layers * 2 * layout.page_size * layout.num_heads * layout.head_dim
        return self._params_nbytes(layout, num_layers) + aligned(codes)

    def _fields(self, layout: PageLayout, rows: Tensor, num_layers: int) -> tuple[Tensor, Tensor | None, Tensor]:
        """Views of rows [k, width]: scales [k, l, 2, H], offsets (affine) [k, l, 2, H], codes [k, l, 2, S, H, D]."""
        k, groups = rows.shape[0], num_layers * 2 * layout.num_heads
        params = rows[:, : groups * 4 * (2 if self.affine else 1)].view(torch.float32)
        scales = params[:, :groups].view(k, num_layers, 2, layout.num_heads)
        lows = params[:, groups:].view(k, num_layers, 2, layout.num_heads) if self.affine else None
        start = self._params_nbytes(layout, num_layers)
        count = groups * layout.page_size * layout.head_dim
        codes = rows[:, start : start + count].view(torch.uint8 if self.affine else torch.int8)
        return scales, lows, codes.view(layer_shape(layout, k, num_layers))

    def _scale_and_low(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Per group [k, l, 2, H]: the step and (affine) the minimum."""
        return quantisation_step(x, _GROUP_DIMS, self.affine, self.name)

    def encode_into(self, layout: PageLayout, kv: Tensor, out: Tensor) -> None:
        x = kv.float()
        scale, lo = self._scale_and_low(x)
        scales, lows, codes = self._fields(layout, out, kv.shape[1])
        scales.copy_(scale)
        step = scale[:, :, :, None, :, None]
        if self.affine:
            lows.copy_(lo)
            codes.copy_(torch.round((x - lo[:, :, :, None, :, None]) / step).clamp_(0, 255))
        else:
            codes.copy_(torch.round(x / step).clamp_(-127, 127))

    def decode(self, layout: PageLayout, rows: Tensor, num_layers: int) -> Tensor:
        scales, lows, codes = self._fields(layout, rows, num_layers)
        x = codes.float() * scales[:, :, :, None, :, None]
        if self.affine:
            x += lows[:, :, :, None, :, None]
        return x.to(layout.dtype)

    def decode_into(self, layout: PageLayout, rows: Tensor, out: Tensor) -> None:
        if layout.dtype != torch.float32:  # the float32 result is rounded once, as `decode` does
            super().decode_into(layout, rows, out)
            return
        scales, lows, codes = self._fields(layout, rows, out.shape[1])
        # Exact copies, then in place, as codes.float() * scale: two plain passes beat one mixed-type
        # one. A few MiB of pages at a time, so that the second pass finds the first's output in cache.
        step = max(1, _DECODE_CHUNK_NBYTES // (out[:1].numel() * out.element_size()))
        for first in range(0, out.shape[0], step):
            pages = slice(first, first + step)
            chunk = out[pages]
            chunk.copy_(codes[pages])
            chunk *= scales[pages, :, :, None, :, None]
            if self.affine:
                chunk += lows[pages, :, :, None, :, None]

    def affine_views(self, layout: PageLayout, rows: Tensor, num_layers: int) -> tuple[Tensor, Tensor, Tensor | None]:
        scales, lows, codes = self._fields(layout, rows, num_layers)
        per_token = codes.shape[:5]  # a page-head's scale, read by each of the page's tokens (stride 0)
        return (codes, scales[:, :, :, None, :].expand(per_token),
                None if lows is None else lows[:, :, :, None, :].expand(per_token))

    def max_abs_error(self, layout: PageLayout, kv: Tensor) -> Tensor:
        x = kv.float()
        scale, lo = self._scale_and_low(x)
        per_value = (slice(None),) * 3 + (None, slice(None), None)  # [k, l, 2, H] -> [k, l, 2, 1, H, 1]
        return quantisation_error_bound(x, scale[per_value], None if lo is None else lo[per_value], layout.dtype)


def quantisation_step(x: Tensor, dims: tuple[int, ...], affine: bool, codec: str,
                      keepdim: bool = False) -> tuple[Tensor, Tensor | None]:
    """The 8-bit step of each group of `x` (its `dims` reduced) and, affine, the group's minimum:
    symmetric `max|x| / 127`, affine `(max - min) / 255`; a constant group gets step 1 (exact).
    Non-finite values are refused, naming the codec."""
    hi = x.amax(dim=dims, keepdim=keepdim)
    if affine:
        lo = x.amin(dim=dims, keepdim=keepdim)
        span, levels = hi - lo, 255.0
    else:
        lo, span, levels = None, torch.maximum(hi, -x.amin(dim=dims, keepdim=keepdim)), 127.0
    if not bool(torch.isfinite(span).all()):
        raise ValueError(f"Codec {codec}: the pages hold non-finite K/V (inf or NaN), which cannot be quantised.")
    scale = span / levels
    return torch.where(scale > 0, scale, torch.ones_like(scale)), lo


def quantisation_error_bound(x: Tensor, step: Tensor, low: Tensor | None, dtype: torch.dtype) -> Tensor:
    """|decoded - x| bound for float32 `x` quantised with `step` and `low` (broadcast to x), decoded to `dtype`:
    half a step, plus float32 rounding of the difference, division and decode (a few ulps of the values
    involved), plus the cast to the layout's dtype."""
    slack = (x.abs() + (0 if low is None else low.abs())) * 2.0**-21
    return step / 2 * (1 + 2.0**-20) + slack + cast_error(dtype, x)
