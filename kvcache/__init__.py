"""User-keyed paged KV cache for HSTU inference (see docs/kvcache.md).

    cfg = KVCacheConfig(num_layers, num_heads, head_dim, page_size=32, num_pages=1024)
    mgr = KVCacheManager(cfg)
    start, length = mgr.get_user_kvdata_info(users)
    meta = mgr.prepare_kv_cache(users, start + length, new_lengths, expected_cached_lengths=length)
    for layer ...: paged_kvcache_ops.append_kvcache(mgr.k_cache(l), mgr.v_cache(l), k, v, meta.new_token_slots)
                   k_all, v_all = paged_kvcache_ops.gather_kvcache(mgr.k_cache(l), mgr.v_cache(l), meta.kv_slots)
    mgr.commit(meta)   # or mgr.rollback(meta) if the forward failed

A caller that shares the manager with other threads plans against `mgr.get_user_versions(users)`
and passes them as `prepare_kv_cache(..., expected_versions=)`: a prepare is then refused when
another caller replaced the tokens meanwhile, also by others of the same length.

Storage tiers (`kvcache.storage`: host memory, a persistent directory, a shared Redis) chain
behind the device: KVCacheConfig(..., persistent_dir=..., redis_url=..., redis_namespace=...).
"""
from . import paged_kvcache_ops
from .cache_version import CacheVersion
from .config import KVCacheConfig
from .errors import KVCacheCapacityError, KVCacheRequestError, KVCacheStaleError
from .events import CacheEvent, CacheEventListener, CacheLocation
from .manager import KVCacheManager
from .metadata import KVCacheMetadata
from .page_data import PageData
from .page_layout import PageLayout
from .policy import EvictionPolicy, LFUPolicy, LRUPolicy
from .read_window import ReadWindow
from .stats import CacheStats
from .storage import (
    DiskHostStorage,
    FailOpenStorage,
    HostEntry,
    HostKVStorage,
    HostPages,
    HostWriteResult,
    InMemoryHostStorage,
    TierDataError,
    TieredHostStorage,
    build_host_storage,
)

__all__ = [
    "CacheEvent",
    "CacheEventListener",
    "CacheLocation",
    "CacheStats",
    "CacheVersion",
    "DiskHostStorage",
    "EvictionPolicy",
    "FailOpenStorage",
    "HostEntry",
    "HostKVStorage",
    "HostPages",
    "HostWriteResult",
    "InMemoryHostStorage",
    "KVCacheCapacityError",
    "KVCacheConfig",
    "KVCacheManager",
    "KVCacheMetadata",
    "KVCacheRequestError",
    "KVCacheStaleError",
    "LFUPolicy",
    "LRUPolicy",
    "PageData",
    "PageLayout",
    "ReadWindow",
    "TierDataError",
    "TieredHostStorage",
    "build_host_storage",
    "paged_kvcache_ops",
]
