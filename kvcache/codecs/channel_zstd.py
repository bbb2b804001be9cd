"""ChannelZstdCodec (`zstd-channel`): lossless float32 / bfloat16 K/V, each value against its channel's.

Byte shuffling plus zstd (`zstd`) codes every value's sign and exponent against one distribution
for the whole page. But each channel (layer, K or V, head, dim) of trained K/V has a scale and
usually a sign of its own: measured on a trained demo checkpoint's pages, the sign and exponent
carry 3.23 bits of entropy over the page, and 1.35 given the channel (docs/kvcache.md, "Lossless
on trained K/V"). So per page and channel this codec stores a reference: the median exponent of
the channel's `page_size` tokens and their majority sign. Each value then becomes

    code      a nibble: the exponent's distance to the reference, clipped to [-3, 3]
              (-4: further, its full distance stored aside), and the sign flip      ~2 bits
    mantissa  the 7 leading mantissa bits, a byte                                  ~6.7 bits
    low bits  the other mantissa bits (16 in float32, none in bfloat16), stored as they are

Two codes share a byte, so zstd's Huffman stage sees pairs of values, and the plane of a channel's
tokens lies together for its match finder: measured on trained pages this stores as few bytes as
rANS over the same symbols, and decodes at zstd's speed with no table to store. The low mantissa
bits are noise (8.0 bits per byte), and cost their size. The transform is tensor and array ops over
a chunk of pages at once; zstd runs three times a page.

A page's bytes: three uint32 lengths, then zstd(references, packed reference signs, the tokens'
times, the distances that did not fit a code), zstd(codes), zstd(mantissa bytes), the low bytes,
left out when they are all zero. A page of zero bits (K/V and times: what a read window offloads
for the tokens no query reads, kvcache/read_window.py) is stored as no bytes, and decoded without
the transform.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..page_data import PageData
from ..page_layout import TIME_NBYTES, PageLayout
from .base import EncodedPages, InPlaceDecodingCodec, zero_pages
from .zstd_contexts import zstd_contexts

_DTYPES = (torch.float32, torch.bfloat16)  # sign + 8 exponent bits in their top two bytes
_NEAR = 3  # exponent distances in [-_NEAR, _NEAR] fit a code; the code's -4 says "stored aside"
_LEVEL = 3  # zstd's level: decoding does not depend on it, so the spec does not name it
_CHUNK_PAGES = 64  # pages transformed at a time: bounds the temporaries of a large write
_LENGTHS = np.dtype("<u4")


class ChannelZstdCodec(InPlaceDecodingCodec):
    lossless = True
    shrinks_zeros = True

    def __init__(self) -> None:
        self._zstd = zstd_contexts("zstd-channel", _LEVEL)

    @property
    def spec(self) -> str:
        return "zstd-channel"

    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages:
        planes = _Planes(layout, self.spec)
        rows = [np.empty(0, np.uint8)] * pages.num_pages  # zero pages stay empty
        stored = np.flatnonzero(~zero_pages(pages))
        for run in range(0, len(stored), _CHUNK_PAGES):
            ids = stored[run : run + _CHUNK_PAGES]
            if ids[-1] - ids[0] == len(ids) - 1:  # a run of pages: a view
                chunk = pages[int(ids[0]) : int(ids[-1]) + 1]
            else:
                index = torch.from_numpy(ids)
                chunk = PageData(pages.kv.index_select(0, index), pages.times.index_select(0, index))
            codes, far, mantissa, low, refs, signs = planes.split(chunk.kv)
            times = chunk.times.contiguous().numpy().view(np.uint8).reshape(chunk.num_pages, -1)
            for i in range(chunk.num_pages):
                header = np.concatenate([refs[i], signs[i], times[i], far[i]])
                parts = [self._compress(part) for part in (header, codes[i], mantissa[i])]
                lengths = np.array([len(p) for p in parts], dtype=_LENGTHS).view(np.uint8)
                rows[ids[i]] = np.concatenate([lengths, *parts] + ([low[i]] if low[i].any() else []))
        return EncodedPages.from_rows(self.spec, rows)

    def decode_into(self, layout: PageLayout, encoded: EncodedPages, out: PageData) -> None:
        """Each chunk of pages joined straight into `out` (a pool's pages on an onload): no decoded copy."""
        self.check_spec(encoded)
        planes = _Planes(layout, self.spec)
        rows = encoded.rows()
        sizes = encoded.sizes()
        empty = torch.from_numpy(np.flatnonzero(sizes == 0))
        if len(empty):
            out.kv.index_fill_(0, empty, 0)
            out.times.index_fill_(0, empty, 0)
        stored = np.flatnonzero(sizes)
        for run in range(0, len(stored), _CHUNK_PAGES):
            ids = stored[run : run + _CHUNK_PAGES]
            chunk = [rows[i] for i in ids]
            k = len(chunk)
            codes = np.empty((k, planes.values // 2), np.uint8)
            mantissa = np.empty((k, planes.values), np.uint8)
            low = np.empty((k, planes.low_nbytes), np.uint8)
            refs, signs = np.empty((k, planes.channels), np.uint8), np.empty((k, planes.sign_nbytes), np.uint8)
            times = np.empty((k, layout.page_size * TIME_NBYTES), np.uint8)
            far = []
            for i, row in enumerate(chunk):
                header, codes[i], mantissa[i], low[i] = self._page_parts(planes, int(ids[i]), row)
                refs[i], signs[i], times[i] = np.split(header[: planes.header_nbytes], planes.header_splits)
                far.append(header[planes.header_nbytes :])
            kv = planes.join(codes, far, mantissa, low, refs, signs, ids)
            if ids[-1] - ids[0] == k - 1:  # a run of pages: a slice write
                pages = slice(int(ids[0]), int(ids[0]) + k)
                out.kv[pages] = kv
                out.times[pages] = torch.from_numpy(times.view("<i8"))
            else:
                index = torch.from_numpy(ids)
                out.kv.index_copy_(0, index, kv.contiguous())
                out.times.index_copy_(0, index, torch.from_numpy(times.view("<i8")))

    def _compress(self, part: np.ndarray) -> np.ndarray:
        return np.frombuffer(self._zstd.compressor.compress(part.tobytes()), dtype=np.uint8)

    def _page_parts(self, planes: _Planes, index: int, row: np.ndarray) -> tuple[np.ndarray, ...]:
        """-> (header with the far distances, codes, mantissa bytes, low bytes) of one page's bytes."""
        try:
            if len(row) < 12:
                raise ValueError(f"{len(row)} bytes hold no lengths")
            sizes = [int(n) for n in row[:12].view(_LENGTHS)]
            if len(row) - 12 - sum(sizes) not in (0, planes.low_nbytes):  # 0: the low bytes are zero
                raise ValueError(f"{len(row)} bytes do not hold the lengths they state")
            ends = np.cumsum([12, *sizes])
            limits = (planes.header_nbytes + planes.values, planes.values // 2, planes.values)
            parts = [self._decompress(row[a:b], limit) for a, b, limit in zip(ends[:-1], ends[1:], limits)]
            if len(parts[0]) < planes.header_nbytes or [len(p) for p in parts[1:]] != list(limits[1:]):
                raise ValueError("its parts decompress to sizes the layout does not have")
        except (ValueError, self._zstd.error) as err:
            raise ValueError(f"Codec {self.spec}: page {index} is not this codec's encoding of the layout's pages "
                             f"({err}).") from None
        low = row[ends[-1] :]
        return (*parts, low if len(low) else np.zeros(planes.low_nbytes, np.uint8))

    def _decompress(self, part: np.ndarray, limit: int) -> np.ndarray:
        return np.frombuffer(self._zstd.decompressor.decompress(part.tobytes(), max_output_size=limit), np.uint8)


class _Planes:
    """The per-channel transform of one layout's pages, and its inverse: byte ops over a chunk of pages.

    A little-endian float32 or bfloat16 value's two top bytes are `sign | exponent[7:1]` and
    `exponent[0] | mantissa[22:16]` (bfloat16: its only bytes); float32's two bottom bytes are the
    low mantissa bits, copied as they are. Values are channel-major (a channel's tokens together).
    """

    def __init__(self, layout: PageLayout, codec: str) -> None:
        if layout.dtype not in _DTYPES:
            raise ValueError(f"Codec {codec} codes float32 or bfloat16 K/V, not {layout.dtype}; use zstd for this layout.")
        self.layout, self.codec = layout, codec
        self.itemsize = layout.dtype.itemsize
        num_layers, _, tokens, heads, dim = layout.page_shape
        self.channels = num_layers * 2 * heads * dim
        self.values = self.channels * tokens  # even: 2 K/V per channel
        self.sign_nbytes = -(-self.channels // 8)
        self.low_nbytes = self.values * (self.itemsize - 2)
        self.header_splits = [self.channels, self.channels + self.sign_nbytes]
        self.header_nbytes = self.channels + self.sign_nbytes + tokens * TIME_NBYTES

    def split(self, kv: Tensor) -> tuple:
        """kv [k, L, 2, S, H, D] -> per page: codes [k, values / 2] uint8 (two nibbles a byte), the far
        distances (a list of uint8 arrays), mantissa bytes [k, values], low bytes [k, low_nbytes], the
        reference exponents [k, channels] and the packed reference signs [k, sign_nbytes]."""
        k = kv.shape[0]
        data = kv.contiguous().view(torch.uint8).view(*kv.shape, self.itemsize)
        data = data.permute(0, 1, 2, 4, 5, 3, 6).contiguous()  # [k, L, 2, H, D, S, bytes]
        top, second = data[..., -1], data[..., -2]
        sign = top >> 7
        exponent = ((top & 0x7F) << 1) | (second >> 7)  # [k, L, 2, H, D, S]
        ref_exponent = exponent.median(dim=-1, keepdim=True).values  # per page and channel
        ref_sign = (2 * sign.sum(dim=-1, keepdim=True, dtype=torch.int16) > sign.shape[-1]).to(torch.uint8)
        distance = (exponent.to(torch.int16) - ref_exponent).reshape(k, -1)
        far = (distance < -_NEAR) | (distance > _NEAR)
        near = torch.where(far, -(_NEAR + 1), distance)
        codes = ((near & 7) << 1 | (sign ^ ref_sign).reshape(k, -1)).to(torch.uint8).view(k, -1, 2)
        far_distances = [d[f].to(torch.uint8).numpy() for d, f in zip(distance, far)]  # mod 256
        return ((codes[..., 0] << 4 | codes[..., 1]).numpy(), far_distances,
                (second & 0x7F).reshape(k, -1).numpy(), data[..., : self.itemsize - 2].reshape(k, -1).numpy(),
                ref_exponent.reshape(k, -1).numpy(), np.packbits(ref_sign.reshape(k, -1).numpy(), axis=1))

    def join(self, codes: np.ndarray, far: list[np.ndarray], mantissa: np.ndarray, low: np.ndarray,
             refs: np.ndarray, signs: np.ndarray, pages: np.ndarray) -> Tensor:
        """The inverse of `split` for the pages numbered `pages`: [k, L, 2, S, H, D] K/V in the layout's dtype
        (a strided view)."""
        k, (num_layers, two, tokens, heads, dim) = len(codes), self.layout.page_shape
        channel_major = (k, num_layers, two, heads, dim, tokens)
        per_channel = (k, num_layers, two, heads, dim, 1)
        packed = torch.from_numpy(codes)
        nibbles = torch.stack([packed >> 4, packed & 15], dim=-1).view(channel_major)
        distance = ((nibbles >> 1) ^ 4).to(torch.int16) - 4  # 3-bit two's complement
        is_far = distance == -(_NEAR + 1)
        counts = is_far.view(k, -1).sum(dim=1).tolist()  # host arrays: no device sync
        for i, (stored, count) in enumerate(zip(far, counts)):
            if len(stored) != count:
                raise ValueError(f"Codec {self.codec}: page {int(pages[i])} is not this codec's encoding of the layout's "
                                 f"pages ({count} far exponents coded, {len(stored)} stored).")
        distance[is_far] = torch.from_numpy(np.concatenate(far)).to(torch.int16)  # row-major: page by page
        exponent = (distance + torch.from_numpy(refs).view(per_channel)).to(torch.uint8)  # mod 256
        reference_sign = torch.from_numpy(np.unpackbits(signs, axis=1)[:, : self.channels]).view(per_channel)
        sign = (nibbles & 1) ^ reference_sign
        data = torch.empty((*channel_major, self.itemsize), dtype=torch.uint8)
        data[..., -1] = (sign << 7) | (exponent >> 1)
        data[..., -2] = ((exponent & 1) << 7) | torch.from_numpy(mantissa).view(channel_major)
        data[..., : self.itemsize - 2] = torch.from_numpy(low).view(*channel_major, self.itemsize - 2)
        return data.permute(0, 1, 2, 5, 3, 4, 6).view(self.layout.dtype).squeeze(-1)
