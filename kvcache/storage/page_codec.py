"""Pages as bytes, for the tiers that store bytes (a directory, Redis).

`fill` writes into a reused staging buffer (`StagingPages`) of page blobs (`kvcache.page_data`:
K/V then times, `page_nbytes` bytes a page); each page is then one row of bytes viewing that
memory (`byte_rows`, no copy), checked with a crc32 per row (`page_crcs`).
"""
from __future__ import annotations

import zlib

import numpy as np

from ..page_data import PageData, blob_pages
from ..page_layout import PageLayout


def byte_rows(pages: PageData) -> np.ndarray:
    """Pages made by `blob_pages` -> [k, page_nbytes] uint8 array sharing their memory."""
    if pages.blob is None:
        raise ValueError("byte_rows needs pages made by blob_pages (one blob per page)")
    return pages.blob.numpy()


def page_crcs(rows: np.ndarray) -> np.ndarray:
    """crc32 of each row of `byte_rows(...)`, uint32 [k]."""
    return np.fromiter((zlib.crc32(row) for row in rows), dtype=np.uint32, count=len(rows))


class StagingPages:
    """A host buffer reused by every write of a tier: `fill` writes it, the tier stores it, and it
    stays readable until the next write (the contract lets a tier chain copy it on)."""

    def __init__(self) -> None:
        self._buffer: PageData | None = None

    def take(self, layout: PageLayout, n: int) -> PageData:
        """`n` page blobs; grows the buffer when needed."""
        if self._buffer is None or self._buffer.num_pages < n:
            self._buffer = blob_pages(layout, n)
        return self._buffer[:n]
