"""Value codecs: the K/V of some layers of a page <-> a fixed number of bytes per page.

The lossy codecs are built from these (`FixedWidthCodec` puts one or several side by side, one
per run of layers, behind the page's times). A value codec sees a page's K/V as
`[k, l, 2, page_size, heads, head_dim]` (l layers) and works on all k pages at once.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from ..page_layout import PageLayout
from . import triton_int8

ALIGN = 8  # every field of an encoded page starts 8-byte aligned, so it can be viewed as any dtype


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def layer_shape(layout: PageLayout, k: int, num_layers: int) -> tuple[int, ...]:
    return (k, num_layers, 2, layout.page_size, layout.num_heads, layout.head_dim)


class ValueCodec(ABC):
    """K/V values of `num_layers` layers of a page to `width(...)` bytes and back."""

    name: str

    @abstractmethod
    def width(self, layout: PageLayout, num_layers: int) -> int:
        """Bytes per page (a multiple of `ALIGN`)."""

    @abstractmethod
    def encode_into(self, layout: PageLayout, kv: Tensor, out: Tensor) -> None:
        """kv [k, l, 2, S, H, D] (any float dtype, any strides) -> out [k, width] uint8 (a view to write)."""

    @abstractmethod
    def decode(self, layout: PageLayout, rows: Tensor, num_layers: int) -> Tensor:
        """rows [k, width] uint8 -> [k, l, 2, S, H, D] in `layout.dtype`."""

    def decode_into(self, layout: PageLayout, rows: Tensor, out: Tensor) -> None:
        """`decode` written into out ([k, l, 2, S, H, D] in `layout.dtype`, any strides): equal to it."""
        out.copy_(self.decode(layout, rows, out.shape[1]))

    def decode_to_pages(self, layout: PageLayout, rows: Tensor, pages: Tensor, page_ids: Tensor) -> None:
        """`decode` scattered into a pool: pages[:, :, page_ids[i]] <- page i decoded, for every layer.

        rows [k, width] uint8 and page_ids [k] int64 on the pool's device; pages [l, 2, P, S, H, D] in
        `layout.dtype` (the pool's pages of these l layers). Codecs whose values are `codes * scale + low`
        (`affine_views`) are decoded by the Triton kernel where it runs, straight into the pages."""
        views = self.affine_views(layout, rows, pages.shape[0]) if triton_int8.applies(rows) else None
        if views is not None:
            triton_int8.decode_into_pages(pages, page_ids, *views)
            return
        decoded = self.decode(layout, rows, pages.shape[0])  # [k, l, 2, S, H, D]
        pages.index_copy_(2, page_ids, decoded.permute(1, 2, 0, 3, 4, 5))

    def affine_views(self, layout: PageLayout, rows: Tensor, num_layers: int) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """(codes [k, l, 2, S, H, D] int8/uint8, scale and low [k, l, 2, S, H] float32 or None) viewing rows,
        for codecs that decode to `codes * scale + low`; None for the others."""
        return None

    @abstractmethod
    def max_abs_error(self, layout: PageLayout, kv: Tensor) -> Tensor:
        """The bound of |decode(encode(kv)) - kv|, elementwise, float32 like kv."""


def cast_error(dtype: torch.dtype, x: Tensor) -> Tensor:
    """Bound of the rounding error of casting float32 `x` to `dtype` (round to nearest): half an ulp,
    `|x| * 2^-mantissa_bits`, plus half the smallest subnormal; 0 for float32 and wider."""
    if dtype.itemsize >= 4:
        return torch.zeros_like(x)
    info = torch.finfo(dtype)
    mantissa_bits = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    return x.abs() * 2.0**-mantissa_bits + info.smallest_normal * info.eps / 2


class CastValues(ValueCodec):
    """K/V stored as `dtype` (bf16 or fp16: a down-cast of fp32 K/V; None: the layout's own dtype, exact).

    fp16 holds magnitudes up to 65504: larger values are clamped there (counted in the bound).
    """

    def __init__(self, name: str, dtype: torch.dtype | None) -> None:
        self.name = name
        self.dtype = dtype

    def stored_dtype(self, layout: PageLayout) -> torch.dtype:
        return layout.dtype if self.dtype is None else self.dtype

    def _count(self, layout: PageLayout, num_layers: int) -> int:
        values = num_layers * 2 * layout.page_size * layout.num_heads * layout.head_dim
        return values * self.stored_dtype(layout).itemsize

    def width(self, layout: PageLayout, num_layers: int) -> int:
        return aligned(self._count(layout, num_layers))

    def _values(self, layout: PageLayout, rows: Tensor, num_layers: int) -> Tensor:
        dtype = self.stored_dtype(layout)
        values = rows[:, : self._count(layout, num_layers)].view(dtype)
        return values.view(layer_shape(layout, rows.shape[0], num_layers))

    def encode_into(self, layout: PageLayout, kv: Tensor, out: Tensor) -> None:
        if self.stored_dtype(layout) == torch.float16 and kv.dtype != torch.float16:
            limit = torch.finfo(torch.float16).max
            kv = kv.clamp(-limit, limit)  # an fp16 overflow would store inf
        self._values(layout, out, kv.shape[1]).copy_(kv)

    def decode(self, layout: PageLayout, rows: Tensor, num_layers: int) -> Tensor:
        return self._values(layout, rows, num_layers).to(layout.dtype)

    def decode_into(self, layout: PageLayout, rows: Tensor, out: Tensor) -> None:
        out.copy_(self._values(layout, rows, out.shape[1]))  # the cast in the copy: one pass, no temporary

    def max_abs_error(self, layout: PageLayout, kv: Tensor) -> Tensor:
        x = kv.float()
        dtype = self.stored_dtype(layout)
        if dtype == kv.dtype:
            return torch.zeros_like(x)
        err = cast_error(dtype, x)
        if dtype == torch.float16:
            err = err + (x.abs() - torch.finfo(torch.float16).max).clamp(min=0)
        return err + cast_error(layout.dtype, x)  # the decoded value is cast back to the layout dtype
