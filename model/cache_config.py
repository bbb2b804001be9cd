"""The KV cache a model is served with: the one place a model's config becomes a `KVCacheConfig`.

The cache stores what the model's attention computes, so its geometry (layers, heads, head
dimension, page size) and its read window (the tokens a sliding-window model still reads) follow
from the model; a caller names only what the cache is for: its pages, capacities, tiers, codec and
device. kvcache/ knows nothing of the model, so the translation lives on the model's side.
"""
from __future__ import annotations

from typing import Any

import torch

from kvcache import KVCacheConfig, PageLayout
from model.config import HSTUConfig


def kv_cache_config(model_config: HSTUConfig, *, num_pages: int, page_size: int | None = None,
                    keep_unread_kv: bool = False, **cache_fields: Any) -> KVCacheConfig:
    """A cache of `num_pages` device pages of `page_size` tokens (None: the model's) for `model_config`.

    `cache_fields` are the other `KVCacheConfig` fields (dtype, device, capacities, tiers, codec);
    each one left out takes `KVCacheConfig`'s default, so that defaults are written there only.
    The read window is the model's (`HSTUConfig.cache_read_window`) unless `keep_unread_kv`: then the
    cache keeps every token, also those the attention window no longer reads (what the window saves
    is measured against that).
    """
    return KVCacheConfig(
        num_layers=model_config.num_layers, num_heads=model_config.num_heads, head_dim=model_config.head_dim,
        page_size=model_config.page_size if page_size is None else page_size, num_pages=num_pages,
        read_window=None if keep_unread_kv else model_config.cache_read_window, **cache_fields,
    )


def window_pages(model_config: HSTUConfig, page_size: int | None = None) -> int:
    """Pages of `page_size` tokens (None: the model's) that one user's largest window fills."""
    return -(-model_config.max_seq_len // (model_config.page_size if page_size is None else page_size))


def page_layout(model_config: HSTUConfig, dtype: torch.dtype, page_size: int | None = None) -> PageLayout:
    """What one page of `model_config`'s K/V in `dtype` holds, pages of `page_size` tokens (None: the model's)."""
    return PageLayout(model_config.num_layers, model_config.num_heads, model_config.head_dim,
                      model_config.page_size if page_size is None else page_size, dtype)
