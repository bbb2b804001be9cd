"""FixedWidthCodec: pages encoded to one fixed-size row each: times, then runs of layers.

A row is `times [page_size] int64` (bit-exact), then for each run of layers the bytes its
`ValueCodec` makes. One codec type serves the plain down-casts (one run: all layers), int8 and
the layer-aware mixes (CacheGen: shallow layers kept at more bits than deep ones, since errors
in early layers propagate through every later one). Encoding and decoding are a few tensor
ops over all pages at once; a fixed width lets the whole batch of pages be one [k, width] view.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from ..page_data import PageData
from ..page_layout import TIME_NBYTES, PageLayout
from .base import EncodedPages, InPlaceDecodingCodec
from .values import ValueCodec


class FixedWidthCodec(InPlaceDecodingCodec):
    """`runs`: (first layer, value codec) in increasing first-layer order, the first at layer 0; a run
    lasts until the next one's first layer, clipped to the layout's layers."""

    def __init__(self, spec: str, runs: Sequence[tuple[int, ValueCodec]], lossless: bool = False) -> None:
        if not runs or runs[0][0] != 0 or any(a[0] >= b[0] for a, b in itertools.pairwise(runs)):
            raise ValueError(f"Codec {spec!r}: runs must start at layer 0 and increase, got {[r[0] for r in runs]}.")
        self._spec = spec
        self._runs = tuple(runs)
        self.lossless = lossless
        self.decodes_on_device = True

    @property
    def spec(self) -> str:
        return self._spec

    def _spans(self, layout: PageLayout) -> list[tuple[int, int, ValueCodec, int, int]]:
        """(first layer, stop layer, codec, byte offset, width) of each run with layers in `layout`."""
        spans, offset = [], layout.page_size * TIME_NBYTES
        bounds = [first for first, _ in self._runs[1:]] + [layout.num_layers]
        for (first, codec), stop in zip(self._runs, bounds):
            stop = min(stop, layout.num_layers)
            if first < stop:
                width = codec.width(layout, stop - first)
                spans.append((first, stop, codec, offset, width))
                offset += width
        return spans

    def page_nbytes(self, layout: PageLayout) -> int:
        """Bytes of every encoded page of `layout`."""
        _, _, _, offset, width = self._spans(layout)[-1]
        return offset + width

    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages:
        k = pages.num_pages
        with torch.inference_mode(False):  # tiers keep these bytes past the caller's inference mode
            rows = torch.empty((k, self.page_nbytes(layout)), dtype=torch.uint8)
        rows[:, : layout.page_size * TIME_NBYTES].view(torch.int64).copy_(pages.times)
        for first, stop, codec, offset, width in self._spans(layout):
            codec.encode_into(layout, pages.kv[:, first:stop], rows[:, offset : offset + width])
        return EncodedPages.from_fixed(self.spec, rows)

    def decode_into(self, layout: PageLayout, encoded: EncodedPages, out: PageData) -> None:
        self.check_spec(encoded)
        rows = encoded.fixed_rows(self.page_nbytes(layout))
        out.times.copy_(rows[:, : layout.page_size * TIME_NBYTES].view(torch.int64))
        for first, stop, codec, offset, width in self._spans(layout):
            codec.decode_into(layout, rows[:, offset : offset + width], out.kv[:, first:stop])

    def decode_to_pages(self, layout: PageLayout, encoded: EncodedPages, kv: torch.Tensor, times: torch.Tensor,
                        page_ids: torch.Tensor) -> None:
        """One scatter of the times and one decode per run of layers (on CUDA, int8's is one kernel launch),
        wherever `encoded`'s bytes are."""
        self.check_spec(encoded)
        rows = encoded.fixed_rows(self.page_nbytes(layout))
        times.index_copy_(0, page_ids, rows[:, : layout.page_size * TIME_NBYTES].view(torch.int64))
        for first, stop, codec, offset, width in self._spans(layout):
            codec.decode_to_pages(layout, rows[:, offset : offset + width], kv[first:stop], page_ids)

    def max_abs_error(self, layout: PageLayout, pages: PageData) -> torch.Tensor:
        return torch.cat([codec.max_abs_error(layout, pages.kv[:, first:stop])
                          for first, stop, codec, _, _ in self._spans(layout)], dim=1)
