"""Where a user's K/V live when they are off the device: the tiers behind the page pool.

`base.py` is the contract every tier implements (`HostKVStorage`) and the values it exchanges;
one tier a file: `memory_tier.py` (host RAM, a slab allocated once, pinned for CUDA devices),
`disk_tier.py` (a local directory that survives restarts and crashes), `redis_tier.py` (a Redis
server shared by nodes). `tier_chain.py` chains them (`TieredHostStorage`, `build_host_storage`),
`fail_open.py` turns a failing tier into misses, `page_codec.py` is how pages become bytes,
`lru.py` the recency and byte bookkeeping the size-bounded tiers share, `page_slab.py` the
memory tier's slab. The Redis tier is imported on use (it needs redis-py).
"""
from .base import HostEntry, HostKVStorage, HostPages, HostWriteResult, PageFill, TierDataError
from .disk_tier import DiskHostStorage, RecoveryReport
from .fail_open import FailOpenStorage
from .memory_tier import InMemoryHostStorage
from .page_slab import HostPageSlab
from .tier_chain import TieredHostStorage, build_host_storage

__all__ = [
    "DiskHostStorage",
    "FailOpenStorage",
    "HostEntry",
    "HostKVStorage",
    "HostPageSlab",
    "HostPages",
    "HostWriteResult",
    "InMemoryHostStorage",
    "PageFill",
    "RecoveryReport",
    "TierDataError",
    "TieredHostStorage",
    "build_host_storage",
]
