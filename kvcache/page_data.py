"""PageData: pages on their way between the device pool and a storage tier.

A page holds `page_size` tokens: their K and V in every layer, and each token's time, an int64
the model writes when it appends a token and reads back when it attends to it (HSTU's relative
time bias needs the timestamp of every cached key). Pages travel as two tensors,

    kv     [k, num_layers, 2 (K, V), page_size, num_heads, head_dim]   layout.dtype
    times  [k, page_size]                                               int64

with strides of the holder's choosing (the in-memory tier hands out layer-major views; each page
row `page_size, num_heads, head_dim` is dense). Tiers that store bytes hold a page as one blob of
`PageLayout.page_nbytes` bytes, K/V then times: `blob_pages` makes pages viewing such blobs, and
`PageData.blob` is their bytes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from .page_layout import PageLayout


@dataclass(frozen=True)
class PageData:
    kv: Tensor  # [k, *layout.page_shape]
    times: Tensor  # [k, page_size] int64
    blob: Tensor | None = None  # [k, page_nbytes] uint8 that kv and times view (pages made by `blob_pages`)

    @property
    def num_pages(self) -> int:
        return self.kv.shape[0]

    def __getitem__(self, pages: slice) -> PageData:
        """Pages `pages` (a slice), viewing the same memory."""
        return PageData(self.kv[pages], self.times[pages], None if self.blob is None else self.blob[pages])

    def copy_(self, src: PageData, non_blocking: bool = False) -> PageData:
        """Copy `src`'s pages into these (same number of pages, any strides and devices)."""
        self.kv.copy_(src.kv, non_blocking=non_blocking)
        self.times.copy_(src.times, non_blocking=non_blocking)
        return self

    def clone(self) -> PageData:
        """A copy in fresh memory (without a blob)."""
        return PageData(self.kv.clone(), self.times.clone())

    def to(self, device: torch.device | str) -> PageData:
        return PageData(self.kv.to(device), self.times.to(device))


def empty_kv(layout: PageLayout, n: int, pin_memory: bool = False) -> Tensor:
    """An uninitialised host tensor [n, *page_shape] of K/V.

    Allocated outside inference mode: the manager runs inside `torch.inference_mode()` when the
    model prepares, and an inference tensor refuses the in-place writes of later calls made
    outside it (an offload into a buffer a promotion allocated, a reused staging buffer).
    """
    with torch.inference_mode(False):
        return torch.empty((n, *layout.page_shape), dtype=layout.dtype, pin_memory=pin_memory)


def empty_times(layout: PageLayout, n: int, pin_memory: bool = False) -> Tensor:
    """An uninitialised host tensor [n, page_size] of token times (outside inference mode, as `empty_kv`)."""
    with torch.inference_mode(False):
        return torch.empty((n, layout.page_size), dtype=torch.int64, pin_memory=pin_memory)


def empty_pages(layout: PageLayout, n: int) -> PageData:
    """`n` uninitialised host pages (K/V and times in tensors of their own)."""
    return PageData(empty_kv(layout, n), empty_times(layout, n))


def blob_pages(layout: PageLayout, n: int) -> PageData:
    """`n` uninitialised pages, each one contiguous blob of `layout.page_nbytes` bytes (page-major);
    made outside inference mode, as `empty_kv`."""
    with torch.inference_mode(False):
        return blob_view(layout, torch.empty((n, layout.page_nbytes), dtype=torch.uint8))


def blob_view(layout: PageLayout, blob: Tensor) -> PageData:
    """Pages viewing `blob` ([n, page_nbytes] uint8, rows dense): K/V then times, as `blob_pages` lays them out."""
    n = blob.shape[0]
    kv = blob[:, : layout.kv_nbytes].view(layout.dtype).view(n, *layout.page_shape)
    times = blob[:, layout.times_offset :].view(torch.int64)
    return PageData(kv, times, blob)


def concat_pages(parts: list[PageData]) -> PageData:
    """The pages of `parts` in order, in fresh memory."""
    return PageData(torch.cat([p.kv for p in parts]), torch.cat([p.times for p in parts]))


class EncodedPageData(ABC):
    """Pages a tier read that are still encoded: the device pool decodes them straight into its pages
    (`decode_into` on the host, `decode_to_pages` on a device), so an onload from an encoded tier writes
    each value once, with no decoded copy in between; everything else asks for `decode()`."""

    @property
    @abstractmethod
    def num_pages(self) -> int: ...

    @abstractmethod
    def decode(self) -> PageData:
        """The pages decoded into fresh host memory."""

    @abstractmethod
    def decode_into(self, dst: PageData) -> None:
        """Decode into `dst` (num_pages pages, any strides, on the host): equal to `decode()`."""

    @abstractmethod
    def page_range(self, start: int, stop: int) -> EncodedPageData:
        """Pages [start, stop), still encoded."""

    @abstractmethod
    def decode_to_pages(self, kv: Tensor, times: Tensor, page_ids: Tensor) -> None:
        """Decode page i into a pool's kv[:, :, page_ids[i]] ([L, 2, P, S, H, D]) and times[page_ids[i]]
        ([P, S]), on their device (page_ids [num_pages] int64 there): equal to `decode()` scattered."""


HostPageData = PageData | EncodedPageData  # what a tier's read hands out


def decoded(pages: HostPageData) -> PageData:
    """`pages` as PageData (decoded if they are encoded)."""
    return pages.decode() if isinstance(pages, EncodedPageData) else pages


def page_range(pages: HostPageData, start: int, stop: int) -> HostPageData:
    """Pages [start, stop) of `pages`, encoded or not (a view)."""
    return pages.page_range(start, stop) if isinstance(pages, EncodedPageData) else pages[start:stop]


def copy_pages(dst: PageData, src: HostPageData) -> None:
    """dst <- src, decoding straight into dst when src is encoded."""
    if isinstance(src, EncodedPageData):
        src.decode_into(dst)
    else:
        dst.copy_(src)
