"""Cache counters: what a capacity planner asks of the cache."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .pool import DevicePagePool
    from .storage import HostKVStorage


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the event counters (monotonic) and of each tier's occupancy (gauges)."""

    # --- counters ---
    hits: int = 0  # prepared users that had reusable cached tokens (in any tier)
    misses: int = 0  # prepared users with nothing cached
    tokens_reused: int = 0  # cached tokens the prepared users reused
    tokens_appended: int = 0  # new tokens committed into the cache (= tokens computed)
    onloaded_bytes: int = 0  # host tier -> device
    offloaded_bytes: int = 0  # device -> host tier
    device_evictions: int = 0  # users dropped from the device (pool pressure or evict_kv_cache)
    host_evictions: int = 0  # users the host tier dropped to make room
    host_rejected_writes: int = 0  # offloads the host tier could not store (user larger than the tier)
    superseded_offloads: int = 0  # offloads not written: a shared tier held more of the user (another node's)
    refusals: int = 0  # requests refused with a KVCacheRequestError
    rollbacks: int = 0  # prepares rolled back
    prefetched_users: int = 0  # users onloaded by `prefetch` ahead of their prepare
    # --- counters of the host tiers (HostKVStorage.counters(), summed over the chain) ---
    tier_failures: int = 0  # calls to a tier that raised: served as a miss / not stored
    tier_timeouts: int = 0  # calls abandoned after the tier's timeout
    tier_corrupt_reads: int = 0  # entries a tier returned or held with bad data (checksum, shape): dropped
    # --- gauges ---
    pages_in_use: int = 0
    pages_owned: int = 0  # held by the users on the device: less than pages_in_use only if pages leaked
    pages_total: int = 0
    users_on_device: int = 0
    users_on_host: int = 0
    host_bytes_used: int = 0
    host_capacity_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        visits = self.hits + self.misses
        return self.hits / visits if visits else 0.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


GAUGES = ("pages_in_use", "pages_owned", "pages_total", "users_on_device", "users_on_host", "host_bytes_used",
          "host_capacity_bytes")
TIER_COUNTERS = {"tier_failures": "failures", "tier_timeouts": "timeouts", "tier_corrupt_reads": "corrupt_reads"}
COUNTERS = tuple(f.name for f in fields(CacheStats) if f.name not in GAUGES and f.name not in TIER_COUNTERS)


def tier_counters(counters: dict[str, int]) -> dict[str, int]:
    """`CacheStats` fields from a storage's `counters()`."""
    return {field: counters.get(name, 0) for field, name in TIER_COUNTERS.items()}


def new_counters() -> dict[str, int]:
    """Mutable counters for the manager; `counters["hits"] += 1` (a misspelt name raises)."""
    return dict.fromkeys(COUNTERS, 0)


def snapshot(counters: dict[str, int], pool: DevicePagePool, host: HostKVStorage, pages_by_user: Iterable[int]
             ) -> CacheStats:
    """The manager's counters with the tiers' counters and the occupancy of the pool and the host tier;
    `pages_by_user`: the pages each user on the device holds."""
    pages_by_user = list(pages_by_user)
    return CacheStats(
        **counters,
        **tier_counters(host.counters()),
        pages_in_use=pool.num_used,
        pages_owned=sum(pages_by_user),
        pages_total=pool.num_pages,
        users_on_device=len(pages_by_user),
        users_on_host=host.num_users,
        host_bytes_used=host.bytes_used,
        host_capacity_bytes=host.capacity_bytes,
    )
