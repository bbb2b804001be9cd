"""Configuration of the KV cache: the model geometry it stores and the capacity of each tier."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .codecs import DEFAULT_CODEC, get_codec
from .page_layout import PageLayout
from .read_window import ReadWindow

EVICTION_POLICIES = ("lru", "lfu")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class KVCacheConfig:
    """Everything `KVCacheManager` needs; validated on construction.

    `num_pages` pages of `page_size` tokens are preallocated on `device` for every layer and
    never grow; `host_capacity_bytes` bounds the default in-memory host tier.

    Lower tiers (docs/kvcache.md, "Storage tiers"), each off unless named: `persistent_dir`, a
    local directory that survives restarts (bounded by `persistent_capacity_bytes`); `redis_url`,
    a Redis server shared by nodes, under `redis_namespace` (pass the model fingerprint, so that
    another model never reads these K/V), bounded by `redis_capacity_bytes`, entries expiring
    `redis_ttl_seconds` after their last use. A tier call taking longer than `tier_timeout_s`
    (None: no bound) is abandoned and served as a miss. `kv_codec` (a spec of `kvcache.codecs`)
    encodes the pages every host tier stores; the default (`DEFAULT_CODEC`, raw) stores them exact and as they are.
    `stage_offloads` (None: on CUDA) gathers the pages of users offloaded together in one copy.
    `read_window` (None: every cached token may be read again) names the tokens a sliding-window
    model still reads; the others leave the device as zeros (kvcache/read_window.py).
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
    persistent_dir: str | None = None
    persistent_capacity_bytes: int = 8 << 30
    redis_url: str | None = None
    redis_namespace: str = ""
    redis_capacity_bytes: int = 8 << 30
    redis_ttl_seconds: int | None = None
    tier_timeout_s: float | None = 0.5
    kv_codec: str = DEFAULT_CODEC
    stage_offloads: bool | None = None
    read_window: ReadWindow | None = None

    @property
    def stages_offloads(self) -> bool:
        """Offloads that happen together leave the device in one gather and copy (kvcache/offload_staging.py):
        `stage_offloads`, or by default on CUDA, where it saves a host wait per user."""
        return self.device.type == "cuda" if self.stage_offloads is None else self.stage_offloads

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
        for name in ("host_capacity_bytes", "persistent_capacity_bytes", "redis_capacity_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"KVCacheConfig.{name} must be an int >= 0, got {value!r}.")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"KVCacheConfig.eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}."
            )
        if not isinstance(self.async_offload, bool):
            raise ValueError(f"KVCacheConfig.async_offload must be a bool, got {self.async_offload!r}.")
        if self.stage_offloads is not None and not isinstance(self.stage_offloads, bool):
            raise ValueError(f"KVCacheConfig.stage_offloads must be a bool or None, got {self.stage_offloads!r}.")
        if self.read_window is not None and not isinstance(self.read_window, ReadWindow):
            raise ValueError(f"KVCacheConfig.read_window must be a kvcache.ReadWindow or None, got {self.read_window!r}.")
        self._check_tiers()
        self._check_codec()

    def _check_codec(self) -> None:
        try:
            canonical = get_codec(self.kv_codec).spec
        except ValueError as exc:
            raise ValueError(f"KVCacheConfig.kv_codec: {exc}") from exc
        object.__setattr__(self, "kv_codec", canonical)

    def _check_tiers(self) -> None:
        if self.persistent_dir is not None:
            if not isinstance(self.persistent_dir, (str, os.PathLike)) or not os.fspath(self.persistent_dir):
                raise ValueError(f"KVCacheConfig.persistent_dir must be a directory path, got {self.persistent_dir!r}.")
            object.__setattr__(self, "persistent_dir", os.fspath(self.persistent_dir))
        if self.redis_url is not None:
            if not isinstance(self.redis_url, str) or not self.redis_url.startswith(REDIS_SCHEMES):
                raise ValueError(f"KVCacheConfig.redis_url must start with one of {REDIS_SCHEMES}, got {self.redis_url!r}.")
            if not isinstance(self.redis_namespace, str) or not self.redis_namespace:
                raise ValueError(
                    "KVCacheConfig.redis_namespace must be a non-empty string when redis_url is set "
                    "(pass the model fingerprint: nodes share K/V only under the same namespace)."
                )
        ttl = self.redis_ttl_seconds
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"KVCacheConfig.redis_ttl_seconds must be a positive int or None, got {ttl!r}.")
        timeout = self.tier_timeout_s
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf
        ):
            raise ValueError(f"KVCacheConfig.tier_timeout_s must be a positive number of seconds or None, got {timeout!r}.")

    @property
    def page_layout(self) -> PageLayout:
        return PageLayout(self.num_layers, self.num_heads, self.head_dim, self.page_size, self.dtype)

    @property
    def pin_host_memory(self) -> bool:
        """Host buffers are pinned when the device is CUDA so that copies can be asynchronous."""
        return self.device.type == "cuda"

    @property
    def device_nbytes(self) -> int:
        """Bytes of the preallocated device pool (K, V and times, all layers)."""
        return self.num_pages * self.page_layout.page_nbytes
