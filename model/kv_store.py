"""The two `KVStore`s a layer can attend through (see model/hstu.py).

`WindowKV` is full recompute: the window is exactly the tokens computed now.
`PagedKV` is incremental serving: new history K/V are appended into the user's pages
and the whole window (cached + new) is gathered back from them.
"""
from __future__ import annotations

import torch

from kvcache import KVCacheManager, KVCacheMetadata, paged_kvcache_ops


class WindowKV:
    def store_and_load(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class PagedKV:
    def __init__(self, manager: KVCacheManager, metadata: KVCacheMetadata):
        self.manager = manager
        self.metadata = metadata

    def store_and_load(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_pages, v_pages = self.manager.k_cache(layer), self.manager.v_cache(layer)
        paged_kvcache_ops.append_kvcache(
            k_pages, v_pages, k.to(k_pages.dtype), v.to(v_pages.dtype), self.metadata.new_token_slots
        )
        k_window, v_window = paged_kvcache_ops.gather_kvcache(k_pages, v_pages, self.metadata.kv_slots)
        return k_window.to(k.dtype), v_window.to(v.dtype)
