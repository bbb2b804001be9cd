"""ZstdCodec: pages compressed with Zstandard, optionally after byte-plane shuffling. Exact.

Float K/V compress poorly as they are: each value's bytes mix a predictable sign and exponent
with noisy mantissa bits. Shuffling (the Blosc / HDF5 filter) regroups a page's bytes by their
place in the value (all first bytes, then all second bytes, ...), so the exponent planes form
long, low-entropy runs that zstd compresses well, while the mantissa planes cost about their
size. The shuffle is one tensor transpose over all pages; zstd runs once per page (C code, the
GIL released) so a page stays one independently decodable row. Times are compressed with the
page, unshuffled: they are 8 bytes of 32 tokens next to kilobytes of K/V.
"""
from __future__ import annotations

import numpy as np
import torch
import zstandard
from torch import Tensor

from ..config import PageLayout
from ..page_data import PageData, blob_pages
from .base import EncodedPages, KVCodec
from .raw import page_blobs


class ZstdCodec(KVCodec):
    lossless = True

    def __init__(self, level: int, shuffle: bool) -> None:
        self.level = level
        self.shuffle = shuffle
        # Contexts are reused (allocation per call costs more than small pages' compression);
        # a codec serves one tier, which its manager's lock serialises.
        self._compressor = zstandard.ZstdCompressor(level=level)
        self._decompressor = zstandard.ZstdDecompressor()

    @property
    def spec(self) -> str:
        return f"zstd:level={self.level},shuffle={int(self.shuffle)}"

    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages:
        blob = page_blobs(layout, pages).blob
        if self.shuffle:
            blob = self._shuffled(layout, blob)
        rows = blob.numpy()
        compress = self._compressor.compress
        return EncodedPages.from_rows(self.spec, [np.frombuffer(compress(row), dtype=np.uint8) for row in rows])

    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        self.check_spec(encoded)
        out = blob_pages(layout, encoded.num_pages)
        dst = torch.empty_like(out.blob) if self.shuffle else out.blob
        plain = dst.numpy()
        decompress = self._decompressor.decompress
        for i, row in enumerate(encoded.rows()):
            page = decompress(row, max_output_size=layout.page_nbytes)
            if len(page) != layout.page_nbytes:
                raise ValueError(f"Codec {self.spec}: page {i} decompresses to {len(page)} bytes, "
                                 f"expected {layout.page_nbytes}; the stored bytes are not this codec's.")
            plain[i] = np.frombuffer(page, dtype=np.uint8)
        if self.shuffle:
            self._unshuffle_into(layout, dst, out.blob)
        return out

    @staticmethod
    def _planes(layout: PageLayout, blob: Tensor) -> Tensor:
        """[k, itemsize, values] view of the K/V bytes of shuffled blob rows."""
        item = layout.dtype.itemsize
        return blob[:, : layout.kv_nbytes].view(blob.shape[0], item, layout.kv_nbytes // item)

    def _shuffled(self, layout: PageLayout, blob: Tensor) -> Tensor:
        item = layout.dtype.itemsize
        out = torch.empty_like(blob)
        values = blob[:, : layout.kv_nbytes].view(blob.shape[0], layout.kv_nbytes // item, item)
        self._planes(layout, out).copy_(values.transpose(1, 2))
        out[:, layout.kv_nbytes :] = blob[:, layout.kv_nbytes :]
        return out

    def _unshuffle_into(self, layout: PageLayout, shuffled: Tensor, blob: Tensor) -> None:
        item = layout.dtype.itemsize
        values = blob[:, : layout.kv_nbytes].view(blob.shape[0], layout.kv_nbytes // item, item)
        values.copy_(self._planes(layout, shuffled).transpose(1, 2))
        blob[:, layout.kv_nbytes :] = shuffled[:, layout.kv_nbytes :]
