"""The seam between the model and a KV cache: where a layer's history K/V go and come from.

The model never calls the cache manager: it takes a `KVStore`. `FullRecompute` is a visit with
nothing cached (the window's keys are the rows just computed). `PagedKV` is incremental serving:
the caller (model/inference.py) prepared the cache for the batch; each layer appends the new
history K/V into their pages and attention reads every key straight from the page pool.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
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

    def layer_kv(self, layer, k, v, num_history_rows, device_inputs):
        return k, v

    @property
    def graph_key(self) -> tuple:
        return ("full",)


class PagedKV:
    """A prepared batch of a paged KV cache (`KVCacheManager.prepare_kv_cache`'s metadata)."""

    def __init__(
        self,
        k_cache: Callable[[int], Tensor],
        v_cache: Callable[[int], Tensor],
        metadata: KVCacheMetadata,
        sink_slot: int | None = None,
    ):
        """`k_cache(l)` / `v_cache(l)` (`KVCacheManager.k_cache`, `.v_cache`) are asked for layer l's pages
        when the forward reaches layer l, right before it appends and reads them, and never earlier:
        that is where the manager makes compute wait for layer l's onload (and no other layer's), so
        the first layers compute while the later ones are still being copied to the device.
        `sink_slot` (`KVCacheManager.sink_slot`) is where padding rows of a bucketed batch append."""
        self._k_cache, self._v_cache = k_cache, v_cache
        self.metadata = metadata
        self.sink_slot = sink_slot
        self.addressing = KeyAddressing(metadata.page_size, metadata.page_indptr.numpy(), metadata.page_indices.numpy())

    @property
    def cached_lengths(self) -> np.ndarray:
        return self.metadata.cached_lengths.numpy()

    def host_inputs(self, shape: BatchShape) -> dict[str, np.ndarray]:
        slots = self.metadata.new_token_slots.numpy()
        padding = shape.history_rows - len(slots)
        if padding:
            if self.sink_slot is None:
                raise ValueError("a bucketed batch needs the cache's sink_slot for its padding rows")
            slots = np.pad(slots, (0, padding), constant_values=self.sink_slot)
        return {"kv.new_token_slots": slots}

    def layer_kv(self, layer, k, v, num_history_rows, device_inputs):
        k_pages, v_pages = self._k_cache(layer), self._v_cache(layer)  # [num_pages, page_size, H, D]; layer ready
        paged_kvcache_ops.append_kvcache(
            k_pages, v_pages, k[:num_history_rows].to(k_pages.dtype), v[:num_history_rows].to(v_pages.dtype),
            device_inputs["kv.new_token_slots"],
        )
        return k_pages.flatten(0, 1), v_pages.flatten(0, 1)  # [num_pages * page_size, H, D]

    @property
    def graph_key(self) -> tuple:
        return ("paged", self._k_cache(0).data_ptr(), self._v_cache(0).data_ptr())  # the page pool it writes
