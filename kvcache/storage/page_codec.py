"""The page codec: pages as host tensors and as bytes.

Tiers that store raw bytes (a directory, Redis) share how pages cross into bytes: `fill` writes
into a reused staging buffer (`StagingPages`), each page is then one row of `page_nbytes` bytes
viewing that memory (`byte_rows`, no copy), checked with a crc32 per row (`page_crcs`).
"""
from __future__ import annotations

import zlib

import numpy as np
import torch
from torch import Tensor

from ..config import PageLayout


def new_pages(layout: PageLayout, n: int, pin_memory: bool = False) -> Tensor:
    """An uninitialised host tensor [n, *page_shape] for a tier to keep or hand out.

    Allocated outside inference mode: the manager runs inside `torch.inference_mode()` when the
    model prepares, and an inference tensor refuses the in-place writes of later calls made
    outside it (an offload into a buffer a promotion allocated, a reused staging buffer).
    """
    with torch.inference_mode(False):
        return torch.empty((n, *layout.page_shape), dtype=layout.dtype, pin_memory=pin_memory)


def byte_rows(pages: Tensor) -> np.ndarray:
    """[k, *page_shape] contiguous CPU tensor -> [k, page_nbytes] uint8 array sharing its memory."""
    return pages.view(torch.uint8).numpy().reshape(pages.shape[0], -1)


def page_crcs(rows: np.ndarray) -> np.ndarray:
    """crc32 of each row of `byte_rows(...)`, uint32 [k]."""
    return np.fromiter((zlib.crc32(row) for row in rows), dtype=np.uint32, count=len(rows))


class StagingPages:
    """A host buffer reused by every write of a tier: `fill` writes it, the tier stores it, and it
    stays readable until the next write (the contract lets a tier chain copy it on)."""

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def take(self, layout: PageLayout, n: int) -> Tensor:
        """[n, *page_shape] in `layout.dtype`, contiguous; grows the buffer when needed."""
        if self._buffer is None or self._buffer.shape[0] < n:
            self._buffer = new_pages(layout, n)
        return self._buffer[:n]
