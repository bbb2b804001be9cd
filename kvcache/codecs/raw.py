"""RawCodec: a page stored as its blob (kvcache/page_data.py: K/V, then times), bit for bit.

What the tiers stored before codecs existed, and the default: no encoding work, and decoding is
a view of the bytes read.
"""
from __future__ import annotations

from ..page_data import PageData, blob_pages, blob_view
from ..page_layout import PageLayout
from .base import EncodedPages, KVCodec


def page_blobs(layout: PageLayout, pages: PageData) -> PageData:
    """`pages` as blob pages: themselves when they are, else a copy into fresh blobs."""
    if pages.blob is not None:
        return pages
    return blob_pages(layout, pages.num_pages).copy_(pages)


class RawCodec(KVCodec):
    lossless = True

    @property
    def spec(self) -> str:
        return "raw"

    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages:
        return EncodedPages.from_fixed(self.spec, page_blobs(layout, pages).blob)

    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        self.check_spec(encoded)
        return blob_view(layout, encoded.fixed_rows(layout.page_nbytes))
