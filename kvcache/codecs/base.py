"""The codec contract: how a K/V page is stored once it leaves the device.

A returning user's K/V is the largest thing the cache stores (`2 x layers x heads x head_dim`
values per token), so the host tiers may keep pages encoded. A codec turns `k` pages
(`PageData`, any strides) into `EncodedPages`: one byte string per page, so that tiers keep
their page granularity (incremental writes replace the last pages only) and a page is decoded
only with the pages it travels with. Every codec keeps the tokens' times bit-exact: HSTU's
relative attention bias reads them for every cached key.

Every encoding is named by a *spec*, `name` or `name:key=value,...` (`codecs/registry.py`
lists the names and their parameters). `KVCodec.spec` is the canonical form (every parameter,
sorted by key); a tier stores it with each entry and decodes the entry with the codec its spec
names, never with the one it happens to be configured with.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..page_data import PageData, empty_pages
from ..page_layout import PageLayout


class CodecSpecError(ValueError):
    """A codec spec that names no codec, or parameters the codec does not take."""


@dataclass(frozen=True)
class CodecSpec:
    """A parsed spec: the codec's name and its parameters as given (strings)."""

    name: str
    params: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        if not isinstance(text, str) or not text.strip():
            raise CodecSpecError(f"A codec spec is a non-empty string like 'int8' or 'int8:mode=affine', got {text!r}.")
        name, _, rest = text.strip().partition(":")
        params: dict[str, str] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key or not value:
                raise CodecSpecError(f"Codec spec {text!r}: parameter {item!r} is not key=value.")
            if key in params:
                raise CodecSpecError(f"Codec spec {text!r}: parameter {key!r} is given twice.")
            params[key] = value
        return cls(name, tuple(sorted(params.items())))

    def __str__(self) -> str:
        if not self.params:
            return self.name
        return f"{self.name}:" + ",".join(f"{k}={v}" for k, v in self.params)


@dataclass(frozen=True)
class EncodedPages:
    """`k` encoded pages: page i is `data[offsets[i]:offsets[i + 1]]`, encoded by the codec `spec` names."""

    spec: str
    data: Tensor  # [offsets[-1]] uint8
    offsets: np.ndarray  # [k + 1] int64, offsets[0] == 0

    @property
    def num_pages(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return int(self.offsets[-1])

    def sizes(self) -> np.ndarray:
        """Bytes of each page, int64 [k]."""
        return np.diff(self.offsets)

    def page_range(self, start: int, stop: int) -> EncodedPages:
        """Pages [start, stop), viewing the same bytes."""
        if not 0 <= start <= stop <= self.num_pages:
            raise IndexError(f"pages [{start}, {stop}) of {self.num_pages} encoded pages")
        offsets = self.offsets[start : stop + 1]
        return EncodedPages(self.spec, self.data[int(offsets[0]) : int(offsets[-1])], offsets - offsets[0])

    def to(self, device: torch.device) -> EncodedPages:
        """The same pages with their bytes on `device` (asynchronous from pinned memory)."""
        return EncodedPages(self.spec, self.data.to(device, non_blocking=True), self.offsets)

    def rows(self) -> list[np.ndarray]:
        """Each page's bytes as a uint8 array viewing `data` (what byte-storing tiers write)."""
        flat = self.data.numpy()
        return [flat[a:b] for a, b in zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist())]

    def fixed_rows(self, width: int) -> Tensor:
        """`data` as [k, width] when every page is `width` bytes; ValueError naming the sizes otherwise."""
        sizes = self.sizes()
        if not (sizes == width).all():
            raise ValueError(f"Encoded pages of {self.spec!r} must be {width} bytes each, got sizes {sizes.tolist()}.")
        return self.data.view(self.num_pages, width)

    @classmethod
    def from_rows(cls, spec: str, rows: list[np.ndarray]) -> EncodedPages:
        """Pages from one byte array each (copied into one buffer)."""
        sizes = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        data = np.concatenate(rows) if rows else np.empty(0, dtype=np.uint8)
        return cls(spec, torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)), offsets)

    @classmethod
    def from_fixed(cls, spec: str, rows: Tensor) -> EncodedPages:
        """Pages from a [k, width] uint8 tensor (viewed, not copied)."""
        k, width = rows.shape
        return cls(spec, rows.contiguous().view(-1), np.arange(k + 1, dtype=np.int64) * width)


def zero_pages(pages: PageData) -> np.ndarray:
    """[k] bool: pages whose K/V and times are all zero bits (what a read window offloads for the tokens
    no query reads, kvcache/read_window.py). Compressing codecs store such a page as no bytes."""
    kv = pages.kv.view(torch.uint8)  # bits, so that -0.0 is not zero; page rows are dense, any strides
    nonzero = kv.any(dim=tuple(range(1, kv.dim()))).bool() | pages.times.any(dim=1)  # any() of uint8 is uint8
    return ~nonzero.numpy()


class KVCodec(ABC):
    """Encodes pages of a `PageLayout` to bytes and back.

    `encode` reads `pages` (k pages, any strides, on the host) and returns their encodings;
    `decode` returns k pages equal to what was encoded (`lossless`) or within the codec's
    documented bound of it (`max_abs_error`), times always bit-exact. Both work on whole pages
    with tensor ops, never per token. `decode` refuses encodings of another spec.
    """

    lossless: bool = False
    # Whether `decode_into` is tensor ops that run wherever its tensors are: the pool then moves the
    # encoded bytes to its device and decodes there (fewer bytes over the bus); otherwise (a CPU
    # library such as zstd) it decodes on the host and moves the decoded pages.
    decodes_on_device: bool = False
    # Whether a page of zero K/V costs far fewer bytes than others (a compressing codec): what makes
    # rewriting the pages a read window no longer reads worth it (kvcache/read_window.py).
    shrinks_zeros: bool = False

    @property
    @abstractmethod
    def spec(self) -> str:
        """The canonical spec (`CodecSpec` text with every parameter): what a tier stores per entry."""

    @abstractmethod
    def encode(self, layout: PageLayout, pages: PageData) -> EncodedPages: ...

    @abstractmethod
    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        """Pages in fresh host memory (a blob view for the raw codec), K/V in `layout.dtype`."""

    def decode_into(self, layout: PageLayout, encoded: EncodedPages, out: PageData) -> None:
        """`decode` written into `out` (encoded.num_pages pages, any strides): equal to it. Codecs that can
        write the values in place (no decoded copy in between) override it."""
        out.copy_(self.decode(layout, encoded))

    def decode_to_pages(self, layout: PageLayout, encoded: EncodedPages, kv: Tensor, times: Tensor,
                        page_ids: Tensor) -> None:
        """`decode` scattered into a pool: page i into kv[:, :, page_ids[i]] ([L, 2, P, S, H, D]) and
        times[page_ids[i]] ([P, S]), on their device. This default decodes on the host and moves the
        pages; codecs whose decode runs anywhere (`decodes_on_device`) take `encoded` on the pool's
        device and write its pages directly."""
        pages = self.decode(layout, encoded)
        times.index_copy_(0, page_ids, pages.times.to(times.device, non_blocking=True))
        kv.index_copy_(2, page_ids, pages.kv.to(kv.device, non_blocking=True).permute(1, 2, 0, 3, 4, 5))

    def max_abs_error(self, layout: PageLayout, pages: PageData) -> Tensor:
        """An upper bound of |decode(encode(pages)).kv - pages.kv| for each element, [k, *page_shape] float32.

        The bound each lossy codec documents and its tests check on random pages; 0 for a lossless one.
        """
        return torch.zeros(pages.kv.shape, dtype=torch.float32)

    def check_spec(self, encoded: EncodedPages) -> None:
        if encoded.spec != self.spec:
            raise ValueError(f"Pages encoded with codec {encoded.spec!r} cannot be decoded by {self.spec!r}.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class InPlaceDecodingCodec(KVCodec):
    """A codec whose decode writes the values where they go (`decode_into`, the one to implement);
    `decode` is that into fresh pages."""

    def decode(self, layout: PageLayout, encoded: EncodedPages) -> PageData:
        out = empty_pages(layout, encoded.num_pages)
        self.decode_into(layout, encoded, out)
        return out

    @abstractmethod
    def decode_into(self, layout: PageLayout, encoded: EncodedPages, out: PageData) -> None: ...
