"""ZstdCodec: pages compressed with Zstandard, optionally after byte-plane shuffling. Exact on top of
the `values` they are stored as: the layout's own dtype (`raw`, exact), or a cast (`bf16`, `fp16`).

Float K/V compress poorly as they are: each value's bytes mix a predictable sign and exponent
with noisy mantissa bits. Shuffling (the Blosc / HDF5 filter) regroups a page's bytes by their
place in the value (all first bytes, then all second bytes, ...), so the exponent planes form
long, low-entropy runs that zstd compresses well, while the mantissa planes cost about their
size. The shuffle is one tensor transpose over all pages; zstd runs once per page (C code, the
GIL released) so a page stays one independently decodable row. Times are compressed with the
page, unshuffled: they are 8 bytes of 32 tokens next to kilobytes of K/V.

Trained fp32 K/V leave zstd little: 23 mantissa bits of each value are noise, and the order-0
entropy of the rest bounds any coder of single values near 1.24x (docs/kvcache.md, "Lossless on
trained K/V"). Cast to bf16 first (`values=bf16`), the same values keep 7 mantissa bits, and zstd
takes another ~1.6x off the cast's 2x, losing nothing beyond the cast.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..page_data import PageData
from ..page_layout import TIME_NBYTES, PageLayout
from .base import EncodedPages, KVCodec, zero_pages
from .fixed_width import FixedWidthCodec
from .raw import RawCodec
from .values import CastValues
from .zstd_contexts import zstd_contexts

CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the `values` a page may be cast to first


class ZstdCodec(KVCodec):
    shrinks_zeros = True

    def __init__(self, level: int, shuffle: bool, values: str = "raw") -> None:
        self.level = level
        self.shuffle = shuffle
        self.values = values
        # What zstd compresses: a fixed-width row per page (the raw page blob, or the cast page's row).
        self._plain = RawCodec() if values == "raw" else FixedWidthCodec(values, [(0, CastValues(values, CASTS[values]))])
        self.lossless = self._plain.lossless
        # Contexts are reused (allocation per call costs more than small pages' compression);
        # a codec serves one tier, which its manager's lock serialises.
        self._zstd = zstd_contexts("zstd", level)

    @property
    def spec(self) -> str:
        base = f"zstd:level={self.level},shuffle={int(self.shuffle)}"
        return base if self.values == "raw" else f"{base},values={self.values}"  # raw: the spec tiers already store

    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages:
        rows = self._plain.encode(layout, pages).fixed_rows(self._width(layout))
        if self.shuffle:
            rows = self._shuffled(layout, rows)
        compress = self._zstd.compressor.compress
        zero = zero_pages(pages)  # stored as no bytes (kvcache/read_window.py offloads such pages)
        return EncodedPages.from_rows(self.spec, [np.empty(0, np.uint8) if z else np.frombuffer(compress(row), np.uint8)
                                                  for row, z in zip(rows.numpy(), zero)])

    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        return self._plain.decode(layout, self._plain_rows(layout, encoded))

    def decode_into(self, layout: PageLayout, encoded: EncodedPages, out: PageData) -> None:
        self._plain.decode_into(layout, self._plain_rows(layout, encoded), out)

    def max_abs_error(self, layout: PageLayout, pages: PageData) -> Tensor:
        return self._plain.max_abs_error(layout, pages)

    def _width(self, layout: PageLayout) -> int:
        return layout.page_nbytes if self.values == "raw" else self._plain.page_nbytes(layout)

    def _value_span(self, layout: PageLayout) -> tuple[int, int, int]:
        """(first byte, bytes, itemsize) of the K/V values in a plain row: what the shuffle regroups."""
        if self.values == "raw":
            return 0, layout.kv_nbytes, layout.dtype.itemsize
        item = CASTS[self.values].itemsize
        return layout.page_size * TIME_NBYTES, layout.kv_nbytes // layout.dtype.itemsize * item, item

    def _plain_rows(self, layout: PageLayout, encoded: EncodedPages) -> EncodedPages:
        """The fixed-width rows `encoded` compresses, [k, width] (decompressed, unshuffled)."""
        self.check_spec(encoded)
        width = self._width(layout)
        with torch.inference_mode(False):
            rows = torch.empty((encoded.num_pages, width), dtype=torch.uint8)
        plain = rows.numpy()
        decompress = self._zstd.decompressor.decompress
        for i, row in enumerate(encoded.rows()):
            if not len(row):  # a page of zero bits
                plain[i] = 0
                continue
            try:
                page = decompress(row, max_output_size=width)
            except self._zstd.error as err:
                raise ValueError(f"Codec {self.spec}: page {i} does not decompress ({err}); the stored bytes are "
                                 f"not this codec's.") from None
            if len(page) != width:
                raise ValueError(f"Codec {self.spec}: page {i} decompresses to {len(page)} bytes, "
                                 f"expected {width}; the stored bytes are not this codec's.")
            plain[i] = np.frombuffer(page, dtype=np.uint8)
        if self.shuffle:
            rows = self._unshuffled(layout, rows)
        return EncodedPages.from_fixed(self._plain.spec, rows)

    def _shuffled(self, layout: PageLayout, rows: Tensor) -> Tensor:
        """Rows with their values' bytes regrouped by place (all first bytes, then all second, ...)."""
        return self._regrouped(layout, rows, to_planes=True)

    def _unshuffled(self, layout: PageLayout, shuffled: Tensor) -> Tensor:
        return self._regrouped(layout, shuffled, to_planes=False)

    def _regrouped(self, layout: PageLayout, rows: Tensor, to_planes: bool) -> Tensor:
        """A copy of `rows` whose value span is transposed between [values, itemsize] and [itemsize, values]."""
        start, nbytes, item = self._value_span(layout)
        by_value = (rows.shape[0], nbytes // item, item)
        by_plane = (rows.shape[0], item, nbytes // item)
        src_shape, dst_shape = (by_value, by_plane) if to_planes else (by_plane, by_value)
        out = rows.clone()
        out[:, start : start + nbytes].view(dst_shape).copy_(rows[:, start : start + nbytes].view(src_shape).transpose(1, 2))
        return out
