"""TieredHostStorage: host tiers chained behind the device (RAM -> local disk -> shared Redis).

The chain is itself a `HostKVStorage`, so the manager sees one host tier:

* Writes go through: to every tier, so that what the lower tiers hold survives a restart and is
  visible to other nodes. An incremental write (`first_page > 0`) continues the entry `info`
  reports; a tier holding exactly that entry gets the new pages only, a tier holding anything else
  is brought up to date with the whole entry, copied from a tier that stored it (or, if none did,
  drops the user: after a write a tier holds the written entry, its previous one, or nothing).
* Reads take the best entry: the tiers may disagree (another node may have written a longer
  history into a shared tier). The upper-most tier's start wins, then the greatest length with
  that start, then the upper tier. The entry read is promoted (copied whole) into the tiers above
  the one it came from. A tier whose read fails is skipped for the next best.
* `drop` drops in every tier. `bytes_used`, `capacity_bytes`, `num_users` and the users evicted
  by a write are the first tier's; each tier's own are in `tiers`, and `counters()` sums them.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from ..codecs import DEFAULT_CODEC
from ..config import KVCacheConfig
from ..page_data import copy_pages
from ..page_layout import PageLayout
from .base import (
    HostEntry,
    HostKVStorage,
    HostPages,
    HostWriteResult,
    PageFill,
    check_write_range,
    continues,
    sum_counters,
)
from .encoded_memory_tier import EncodedMemoryStorage
from .memory_tier import InMemoryHostStorage


class TieredHostStorage(HostKVStorage):
    """`tiers[0]` is the fastest (the one the device onloads from most); see the module docstring."""

    def __init__(self, tiers: Sequence[HostKVStorage]) -> None:
        if not tiers:
            raise ValueError("TieredHostStorage needs at least one tier.")
        self.tiers = tuple(tiers)
        # Users read since the last write or drop: a promotion must not evict them from a tier,
        # their pages may be views of its memory that the caller is about to onload.
        self._reading: set[int] = set()

    def bind(self, layout: PageLayout) -> None:
        super().bind(layout)
        for tier in self.tiers:
            tier.bind(layout)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def counters(self) -> dict[str, int]:
        return sum_counters(*(tier.counters() for tier in self.tiers))

    @property
    def shared(self) -> bool:  # type: ignore[override]
        """Only when every tier is: a node's own tier in front makes the chain partly its own."""
        return all(tier.shared for tier in self.tiers)

    @property
    def capacity_bytes(self) -> int:
        return self.tiers[0].capacity_bytes

    @property
    def bytes_used(self) -> int:
        return self.tiers[0].bytes_used

    @property
    def num_users(self) -> int:
        return self.tiers[0].num_users

    # ------------------------------------------------------------------ the contract
    def info(self, user_id: int) -> HostEntry | None:
        return _best(self._infos(user_id))

    def own_info(self, user_id: int) -> HostEntry | None:
        return _best([tier.own_info(user_id) for tier in self.tiers])

    def read(self, user_id: int) -> HostPages | None:
        entries = self._infos(user_id)
        for i in _preference(entries):
            hp = self.tiers[i].read(user_id)
            if hp is None:  # failed or lost meanwhile: the tier dropped or hid it
                continue
            for upper in self.tiers[:i]:
                upper.write(user_id, hp.start_pos, hp.length, 0, _copy_of(hp), self._reading, hp.tag)
            self._reading.add(user_id)
            return hp
        return None

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        self._reading.clear()
        entries = self._infos(user_id)
        order = _preference(entries)
        base = entries[order[0]] if order else None  # the entry an incremental write continues
        check_write_range(self.layout, user_id, length, first_page)
        if not continues(self.layout, start_pos, first_page, base):
            # the caller read an entry a tier has lost since (another node dropped it, a TTL): this
            # user's write is not stored, and the caller's next offload writes it whole
            return HostWriteResult(False, ())
        direct = [i for i, e in enumerate(entries) if e == base] if first_page else list(range(len(self.tiers)))
        behind = [i for i in range(len(self.tiers)) if i not in direct]

        results: list[HostWriteResult | None] = [None] * len(self.tiers)
        relay = _Relay(fill)
        try:
            for i in direct:
                results[i] = self.tiers[i].write(user_id, start_pos, length, first_page, relay, protect, tag)
        except BaseException:  # `fill` failed: the entry may be half-written anywhere
            for tier in self.tiers:
                tier.drop(user_id)
            raise
        source = next((i for i in direct if results[i].stored), None)
        if behind:
            whole = self.tiers[source].read(user_id) if source is not None else None
            for i in behind:
                if whole is not None and whole.entry == (start_pos, length, tag):
                    results[i] = self.tiers[i].write(user_id, start_pos, length, 0, _copy_of(whole), protect, tag)
                else:
                    self.tiers[i].drop(user_id)
        stored = any(r is not None and r.stored for r in results)
        return HostWriteResult(stored, results[0].evicted if results[0] is not None else ())

    def drop(self, user_id: int) -> bool:
        self._reading.clear()
        dropped = [tier.drop(user_id) for tier in self.tiers]
        return any(dropped)

    def _infos(self, user_id: int) -> list[HostEntry | None]:
        return [tier.info(user_id) for tier in self.tiers]


def _best(entries: Sequence[HostEntry | None]) -> HostEntry | None:
    order = _preference(entries)
    return entries[order[0]] if order else None


def _preference(entries: Sequence[HostEntry | None]) -> list[int]:
    """Tiers to read from, best first: the upper-most tier's start, longest first, upper first on ties."""
    first = next((e for e in entries if e is not None), None)
    if first is None:
        return []
    same = [i for i, e in enumerate(entries) if e is not None and e.start_pos == first.start_pos]
    return sorted(same, key=lambda i: (-entries[i].length, i))


class _Relay:
    """The caller's `fill` for the first tier that asks, a copy of what it filled for the others
    (a tier's fill buffer stays readable until the next call to that tier)."""

    def __init__(self, fill: PageFill) -> None:
        self._fill = fill
        self._filled = None

    def __call__(self, dst) -> None:
        if self._filled is None:
            self._fill(dst)
            self._filled = dst
        else:
            dst.copy_(self._filled)


def _copy_of(hp: HostPages) -> PageFill:
    return lambda dst: copy_pages(dst, hp.pages)


def build_host_storage(config: KVCacheConfig) -> HostKVStorage:
    """The tiers `config` names: in-memory, then [fail-open disk], then [fail-open Redis], each storing
    pages encoded by `config.kv_codec` (the in-memory tier of a codec other than raw keeps encoded rows,
    `EncodedMemoryStorage`, instead of the raw page slab).

    Only the in-memory tier when no other is configured. The lower tiers
    are wrapped in `FailOpenStorage`: the disk tier with a `tier_timeout_s` bound on each call
    (run on a worker thread); the Redis tier enforces the same bound as its socket timeout.
    """
    memory: HostKVStorage
    if config.kv_codec == DEFAULT_CODEC:
        memory = InMemoryHostStorage(config.host_capacity_bytes, pin_memory=config.pin_host_memory)
    else:
        memory = EncodedMemoryStorage(config.host_capacity_bytes, config.kv_codec)
    tiers: list[HostKVStorage] = [memory]
    if config.persistent_dir is not None:
        from .disk_tier import DiskHostStorage
        from .fail_open import FailOpenStorage

        disk = DiskHostStorage(config.persistent_dir, config.persistent_capacity_bytes, codec=config.kv_codec)
        tiers.append(FailOpenStorage(disk, f"disk:{config.persistent_dir}", timeout_s=config.tier_timeout_s))
    if config.redis_url is not None:
        from .fail_open import FailOpenStorage
        from .redis_tier import RedisHostStorage  # imports redis-py: only when configured

        redis_tier = RedisHostStorage(
            config.redis_url, config.redis_namespace, config.redis_capacity_bytes,
            ttl_seconds=config.redis_ttl_seconds, timeout_s=config.tier_timeout_s, codec=config.kv_codec,
        )
        tiers.append(FailOpenStorage(redis_tier, "redis"))
    return memory if len(tiers) == 1 else TieredHostStorage(tiers)
