"""TierCodec: how a tier encodes what it stores and decodes what it reads.

A tier writes with the codec it is configured with and stores that codec's spec with every
entry; it reads an entry with the codec the entry's spec names (kept here, one per spec), so
entries written by another node or an earlier run with another codec still decode right. An
incremental write onto an entry of another spec would leave one entry in two encodings, so the
tier rewrites it whole (`whole_fill`: the kept pages, decoded, then the new ones).
"""
from __future__ import annotations

from collections.abc import Callable

from ..codecs import EncodedPages, KVCodec, get_codec
from ..config import PageLayout
from ..page_data import PageData
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
                        on_failed_fill: Callable[[], None]) -> list:
        """A write's new pages: `fill` writes them into a reused staging buffer, then they are encoded,
        one row of bytes a page. A fill that raises calls `on_failed_fill` first (the tier contract:
        the entry is dropped) and the error propagates."""
        dst = self._staging.take(layout, num_pages)
        try:
            fill(dst)
        except BaseException:
            on_failed_fill()
            raise
        return self.codec.encode(layout, dst).rows()

    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        """Decoded with the codec `encoded.spec` names; ValueError for a spec no codec takes (bad stored data)."""
        reader = self._readers.get(encoded.spec)
        if reader is None:
            reader = self._readers[encoded.spec] = get_codec(encoded.spec)
        if reader.spec != encoded.spec:  # a non-canonical spec was stored: not written by a tier
            raise ValueError(f"Stored codec spec {encoded.spec!r} is not canonical ({reader.spec!r}).")
        return reader.decode(layout, encoded)


def whole_fill(kept: PageData, first_page: int, fill: PageFill) -> PageFill:
    """A fill of pages `[0, n)` from `fill`, which fills `[first_page, n)`: pages before it copied from `kept`."""

    def fill_whole(dst: PageData) -> None:
        dst[:first_page].copy_(kept[:first_page])
        fill(dst[first_page:])

    return fill_whole
