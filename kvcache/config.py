"""Configuration of the KV cache: the model geometry it stores and the capacity of each tier."""
from __future__ import annotations

from dataclasses import dataclass

import torch

EVICTION_POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class PageLayout:
    """What one page holds: `page_size` tokens of K and V for every layer.

    The unit every tier exchanges. A page in transit (host tier, offload buffers) has shape
    `page_shape = [num_layers, 2 (K, V), page_size, num_heads, head_dim]`, so that one page is
    one contiguous blob for tiers that store bytes.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.page_size, self.num_heads, self.head_dim)

    @property
    def token_nbytes(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return self.num_layers * 2 * self.num_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_nbytes(self) -> int:
        return self.token_nbytes * self.page_size

    def num_pages(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)


@dataclass(frozen=True)
class KVCacheConfig:
    """Everything `KVCacheManager` needs; validated on construction.

    `num_pages` pages of `page_size` tokens are preallocated on `device` for every layer and
    never grow; `host_capacity_bytes` bounds the default in-memory host tier.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int = 32
    num_pages: int = 1024
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    host_capacity_bytes: int = 1 << 30
    eviction_policy: str = "lru"
    async_offload: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "page_size", "num_pages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVCacheConfig.{name} must be a positive int, got {value!r}.")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"KVCacheConfig.dtype must be a floating torch.dtype, got {self.dtype!r}.")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"KVCacheConfig.device is not a device: {self.device!r}.") from exc
        object.__setattr__(self, "device", device)
        capacity = self.host_capacity_bytes
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"KVCacheConfig.host_capacity_bytes must be an int >= 0, got {capacity!r}.")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"KVCacheConfig.eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}."
            )
        if not isinstance(self.async_offload, bool):
            raise ValueError(f"KVCacheConfig.async_offload must be a bool, got {self.async_offload!r}.")

    @property
    def page_layout(self) -> PageLayout:
        return PageLayout(self.num_layers, self.num_heads, self.head_dim, self.page_size, self.dtype)

    @property
    def pin_host_memory(self) -> bool:
        """Host buffers are pinned when the device is CUDA so that copies can be asynchronous."""
        return self.device.type == "cuda"

    @property
    def device_nbytes(self) -> int:
        """Bytes of the preallocated device pool (K and V, all layers)."""
        return self.num_pages * self.page_layout.page_nbytes
