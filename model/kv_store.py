"""The seam between the model and a KV cache: where a layer's history K/V go and come from.

The model never calls the cache manager: it takes a `KVStore`. `FullRecompute` is a visit with
nothing cached (the window's keys are the rows just computed). `PagedKV` is incremental serving:
the caller (model/inference.py) prepared the cache for the batch; the forward appends the new
history tokens' times (once) and each layer its K/V into their pages, and attention reads every
key, and its time, straight from the page pool.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
from torch import Tensor

from kvcache import KVCacheMetadata, paged_kvcache_ops
from model.attention import KeyAddressing
from model.batch_shape import BatchShape


class KVStore(Protocol):
    @property
    def cached_lengths(self) -> np.ndarray:
        """[B] tokens already cached before each user's computed history tokens."""
        ...

    @property
    def addressing(self) -> KeyAddressing:
        """How attention finds key position j of user b."""
        ...

    def host_inputs(self, shape: BatchShape) -> dict[str, np.ndarray]:
        """Arrays the store needs on the device (packed into the batch's one upload)."""
        ...

    def key_stamps(self, query_stamps: Tensor, num_history_rows: int, device_inputs: Mapping[str, Tensor]) -> Tensor:
        """Store the new history tokens' stamps (time and tag, model/attention/token_stamp.py: rows
        [0, num_history_rows) of query_stamps [T + 1] int64) and return the stamp of every key row attention
        reads ([R] int64, indexed by `addressing`). Once per forward."""
        ...

    def layer_kv(
        self, layer: int, k: Tensor, v: Tensor, num_history_rows: int, device_inputs: Mapping[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Store the new history K/V (rows [0, num_history_rows) of k/v [T, H, D]) and return the
        key and value rows attention reads ([R, H, D], indexed by `addressing`)."""
        ...

    @property
    def graph_key(self) -> tuple:
        """What a captured CUDA graph of a forward through this store depends on besides the batch shape."""
        ...


class FullRecompute:
    """Nothing cached: every user's window is exactly its history rows of this batch."""

    addressing = KeyAddressing(page_size=0)

    def __init__(self, batch_size: int) -> None:
        self._cached = np.zeros(batch_size, dtype=np.int64)

    @property
    def cached_lengths(self) -> np.ndarray:
        return self._cached

    def host_inputs(self, shape: BatchShape) -> dict[str, np.ndarray]:
        return {}

    def key_stamps(self, query_stamps, num_history_rows, device_inputs):
        return query_stamps

    def layer_kv(self, layer, k, v, num_history_rows, device_inputs):
        return k, v

    @property
    def graph_key(self) -> tuple:
        return ("full",)


class PagedCache(Protocol):
    """What `PagedKV` reads of a cache (`KVCacheManager` is one)."""

    def k_cache(self, layer: int) -> Tensor: ...

    def v_cache(self, layer: int) -> Tensor: ...

    def times_cache(self) -> Tensor: ...

    @property
    def sink_slot(self) -> int: ...


class PagedKV:
    """A prepared batch of a paged KV cache (`KVCacheManager.prepare_kv_cache`'s metadata)."""

    def __init__(self, cache: PagedCache, metadata: KVCacheMetadata):
        """`cache.k_cache(l)` / `.v_cache(l)` are asked for layer l's pages when the forward reaches layer l,
        right before it appends and reads them, and never earlier: that is where the manager makes compute
        wait for layer l's onload (and no other layer's), so the first layers compute while the later ones
        are still being copied to the device; `cache.times_cache()` likewise, before layer 0. Padding rows
        of a bucketed batch append to `cache.sink_slot`."""
        self._cache = cache
        self.metadata = metadata
        self.sink_slot = cache.sink_slot
        self.addressing = KeyAddressing(metadata.page_size, metadata.page_indptr.numpy(), metadata.page_indices.numpy())

    @property
    def cached_lengths(self) -> np.ndarray:
        return self.metadata.cached_lengths.numpy()

    def host_inputs(self, shape: BatchShape) -> dict[str, np.ndarray]:
        slots = self.metadata.new_token_slots.numpy()
        padding = shape.history_rows - len(slots)
        if padding:
            slots = np.pad(slots, (0, padding), constant_values=self.sink_slot)
        return {"kv.new_token_slots": slots}

    def key_stamps(self, query_stamps, num_history_rows, device_inputs):
        # The pool's per-slot int64 ("times" to the cache, which never reads them) holds the model's stamps.
        stamps = self._cache.times_cache()  # [num_pages, page_size]; onloaded stamps ready
        paged_kvcache_ops.append_times(stamps, query_stamps[:num_history_rows], device_inputs["kv.new_token_slots"])
        return stamps.view(-1)

    def layer_kv(self, layer, k, v, num_history_rows, device_inputs):
        k_pages, v_pages = self._cache.k_cache(layer), self._cache.v_cache(layer)  # [num_pages, page_size, H, D]; ready
        paged_kvcache_ops.append_kvcache(
            k_pages, v_pages, k[:num_history_rows].to(k_pages.dtype), v[:num_history_rows].to(v_pages.dtype),
            device_inputs["kv.new_token_slots"],
        )
        return k_pages.flatten(0, 1), v_pages.flatten(0, 1)  # [num_pages * page_size, H, D]

    @property
    def graph_key(self) -> tuple:
        # The cache whose pool the graph writes (allocated once, it never moves), not its pages: asking for them
        # would make the stream wait for every onload issued since this batch was prepared (the next batch's
        # prefetch, which the replay must overlap).
        return ("paged", self._cache)
