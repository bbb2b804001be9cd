"""TierCodec: how a tier encodes what it stores and decodes what it reads.

A tier writes with the codec it is configured with and stores that codec's spec with every
entry; it reads an entry with the codec the entry's spec names (kept here, one per spec), so
entries written by another node or an earlier run with another codec still decode right. An
incremental write onto an entry of another spec would leave one entry in two encodings, so the
tier rewrites it whole (`whole_fill`: the kept pages, decoded, then the new ones).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..codecs import EncodedPages, KVCodec, get_codec
from ..page_data import EncodedPageData, PageData, concat_pages
from ..page_layout import PageLayout
from .base import PageFill
from .page_codec import StagingPages


class TierCodec:
    def __init__(self, spec: str) -> None:
        self.codec: KVCodec = get_codec(spec)
        self._readers: dict[str, KVCodec] = {self.codec.spec: self.codec}
        self._staging = StagingPages()

    @property
    def spec(self) -> str:
        return self.codec.spec

    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages:
        return self.codec.encode(layout, pages)

    def fill_and_encode(self, layout: PageLayout, num_pages: int, fill: PageFill,
                        on_failed_fill: Callable[[], None], owned: bool = False) -> EncodedPages:
        """A write's new pages: `fill` writes them into a reused staging buffer, then they are encoded.
        The encoding may view that buffer (the raw codec's does) unless `owned`, for a tier that keeps
        it past the next write. A fill that raises calls `on_failed_fill` first (the tier contract: the
        entry is dropped) and the error propagates."""
        dst = self._staging.take(layout, num_pages)
        try:
            fill(dst)
        except BaseException:
            on_failed_fill()
            raise
        encoded = self.codec.encode(layout, dst)
        if owned and encoded.data.untyped_storage().data_ptr() == dst.kv.untyped_storage().data_ptr():
            encoded = EncodedPages(encoded.spec, encoded.data.clone(), encoded.offsets)
        return encoded

    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        """Decoded with the codec `encoded.spec` names; ValueError for a spec no codec takes (bad stored data)."""
        return self._reader(encoded.spec).decode(layout, encoded)

    def deferred(self, layout: PageLayout, parts: Sequence[EncodedPages]) -> EncodedPageData:
        """The pages of `parts` in order, to be decoded where they are copied to (the device pool decodes
        into its pages). Parts may come from different writes, so each is decoded with its own spec."""
        decodes = [_DeferredDecode(self._reader(part.spec), layout, part) for part in parts]
        return decodes[0] if len(decodes) == 1 else _Concatenated(decodes)

    def _reader(self, spec: str) -> KVCodec:
        reader = self._readers.get(spec)
        if reader is None:
            reader = self._readers[spec] = get_codec(spec)
        if reader.spec != spec:  # a non-canonical spec was stored: not written by a tier
            raise ValueError(f"Stored codec spec {spec!r} is not canonical ({reader.spec!r}).")
        return reader


class _DeferredDecode(EncodedPageData):
    def __init__(self, codec: KVCodec, layout: PageLayout, encoded: EncodedPages) -> None:
        self._codec, self._layout, self._encoded = codec, layout, encoded

    @property
    def num_pages(self) -> int:
        return self._encoded.num_pages

    def decode(self) -> PageData:
        return self._codec.decode(self._layout, self._encoded)

    def decode_into(self, dst: PageData) -> None:
        self._codec.decode_into(self._layout, self._encoded, dst)

    def page_range(self, start: int, stop: int) -> _DeferredDecode:
        """Pages [start, stop), still encoded."""
        return _DeferredDecode(self._codec, self._layout, self._encoded.page_range(start, stop))

    def decode_to_pages(self, kv: torch.Tensor, times: torch.Tensor, page_ids: torch.Tensor) -> None:
        encoded = self._encoded.to(kv.device) if self._codec.decodes_on_device else self._encoded
        self._codec.decode_to_pages(self._layout, encoded, kv, times, page_ids)


class _Concatenated(EncodedPageData):
    """Encoded parts one after the other, as one run of pages."""

    def __init__(self, parts: Sequence[EncodedPageData]) -> None:
        self._parts = list(parts)
        self._starts = np.cumsum([0] + [part.num_pages for part in self._parts])

    @property
    def num_pages(self) -> int:
        return int(self._starts[-1])

    def decode(self) -> PageData:
        return concat_pages([part.decode() for part in self._parts])

    def decode_to_pages(self, kv: torch.Tensor, times: torch.Tensor, page_ids: torch.Tensor) -> None:
        for part, start in zip(self._parts, self._starts[:-1].tolist()):
            part.decode_to_pages(kv, times, page_ids[start : start + part.num_pages])

    def decode_into(self, dst: PageData) -> None:
        for part, start in zip(self._parts, self._starts[:-1].tolist()):
            part.decode_into(dst[start : start + part.num_pages])

    def page_range(self, start: int, stop: int) -> EncodedPageData:
        pieces = []
        for part, first in zip(self._parts, self._starts[:-1].tolist()):
            lo, hi = max(start - first, 0), min(stop - first, part.num_pages)
            if lo < hi:
                pieces.append(part.page_range(lo, hi))
        return pieces[0] if len(pieces) == 1 else _Concatenated(pieces)


def whole_fill(kept: PageData, first_page: int, fill: PageFill) -> PageFill:
    """A fill of pages `[0, n)` from `fill`, which fills `[first_page, n)`: pages before it copied from `kept`."""

    def fill_whole(dst: PageData) -> None:
        dst[:first_page].copy_(kept[:first_page])
        fill(dst[first_page:])

    return fill_whole
