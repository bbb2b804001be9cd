"""What one page of the KV cache holds: the unit every tier, codec and the device pool exchange.

Its own module, below the cache's config and the codecs alike: both read a page's shape and bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TIME_NBYTES = 8  # each token's time: an int64


@dataclass(frozen=True)
class PageLayout:
    """What one page holds: `page_size` tokens of K and V for every layer, and each token's time.

    The unit every tier exchanges (as `kvcache.PageData`): K/V of shape
    `page_shape = [num_layers, 2 (K, V), page_size, num_heads, head_dim]` and `page_size` int64
    times (the model's timestamp of each token, which attention needs for every cached key). A
    tier that stores bytes keeps a page as one blob of `page_nbytes`: K/V, padding to 8 bytes,
    then the times.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one page's K/V."""
        return (self.num_layers, 2, self.page_size, self.num_heads, self.head_dim)

    @property
    def kv_nbytes(self) -> int:
        """Bytes of one page's K/V (all layers)."""
        return self.num_layers * 2 * self.page_size * self.num_heads * self.head_dim * self.dtype.itemsize

    @property
    def times_offset(self) -> int:
        """Where a page blob's times start: after its K/V, aligned for int64."""
        return -(-self.kv_nbytes // TIME_NBYTES) * TIME_NBYTES

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: K/V and times (what a tier stores, and what capacities count)."""
        return self.times_offset + self.page_size * TIME_NBYTES

    @property
    def token_nbytes(self) -> float:
        """Bytes one token takes in a page (K/V of every layer and its time)."""
        return self.page_nbytes / self.page_size

    def num_pages(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)
