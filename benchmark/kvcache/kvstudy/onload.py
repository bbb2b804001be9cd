"""Onload: what a returning user's reload from each tier costs, per codec, against recomputing its history.

tier_benchmark's reload, per tier, codec (`kvcache.codecs`: how the tier stores pages) and history
length: the user's L tokens are in the tier, encoded, and not on the device; `prepare_kv_cache` of
one new token onloads them (tier `info` + `read` + decode + the copy into fresh device pages), then
`rollback`. Medians of `repeats` rounds after a warm-up. The recompute it is set against is the
visits section's prefill of the same history, measured in the same run; a visit served by a
reload costs reload + cached visit, one by recompute the full visit.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmark.kvcache.tiers import USER, TierFactory, cache_config, crossover, loaded_cache, tier_factories, time_reload
from kvcache.local_redis import LocalRedisServer, redis_server_binary
from model.recommender import HSTURecommender

from .visits import VisitRow

REDIS_MISSING = "redis-server is not installed (and no --redis_url was given): the Redis tier is left out"


@dataclass(frozen=True)
class OnloadRow:
    tier: str
    codec: str
    history: int
    stored_bytes: int  # the user's bytes in the tier
    reload_ms: float
    recompute_ms: float  # the history's prefill
    speedup: float  # recompute / reload (> 1: reloading pays)
    visit_reload_ms: float  # reload + the cached visit
    visit_full_ms: float  # the full-recompute visit
    visit_speedup: float  # full visit / (reload + cached visit)


@contextmanager
def redis_url_for_run(workdir: Path, given: str | None) -> Iterator[tuple[str | None, str | None]]:
    """-> (url, note): `given`, else a redis-server of the run's own on loopback and a free port
    (stopped on exit), else (None, why the tier is left out)."""
    if given is not None:
        yield given, None
    elif redis_server_binary() is None:
        yield None, REDIS_MISSING
    else:
        with LocalRedisServer(workdir / "redis") as server:
            yield server.url, None


def reload_ms(model: HSTURecommender, make_tier: TierFactory, history: int, repeats: int, device: torch.device
              ) -> tuple[float, int]:
    """-> (median ms of a reload, the bytes the tier stores for the user)."""
    cache = loaded_cache(model.config, model.dtype, history, make_tier(history), device)
    try:
        stored = cache.host_storage.bytes_used
        time_reload(cache, history)  # warm-up
        return statistics.median(time_reload(cache, history) for _ in range(repeats)) * 1e3, stored
    finally:
        cache.invalidate_kv_cache([USER])  # frees the tier's space (Redis keys, files)
        cache.close()
        cache.host_storage.close()  # built here: the manager does not own it


def measure_onload(model: HSTURecommender, tiers: list[str], codecs: list[str], visits: list[VisitRow], repeats: int,
                   workdir: Path, redis_url: str | None, device: torch.device) -> list[OnloadRow]:
    """Every tier in `tiers` with every codec at every history of `visits` (the Redis tier needs `redis_url`)."""
    longest = max(v.history for v in visits)
    layout = cache_config(model.config, model.dtype, longest).page_layout
    capacity = 2 * layout.num_pages(longest) * layout.page_nbytes  # every tier holds the user whole, raw or encoded
    factories = {codec: dict(zip(tiers, tier_factories(tiers, workdir, redis_url, capacity, [codec]).values()))
                 for codec in codecs}  # one codec: its tiers in the order named
    rows = []
    shapes = [(v, tier, codec) for v in visits for tier in tiers for codec in codecs]
    for visit, tier, codec in tqdm(shapes, desc="onload: histories x tiers x codecs", leave=False):
        ms, stored = reload_ms(model, factories[codec][tier], visit.history, repeats, device)
        rows.append(OnloadRow(tier, codec, visit.history, stored, ms, visit.prefill_ms, visit.prefill_ms / ms,
                              ms + visit.cached_ms, visit.full_ms, visit.full_ms / (ms + visit.cached_ms)))
    return rows


Crossovers = dict[str, dict[str, int | None]]  # codec -> tier -> shortest history from which reloading wins


def _crossovers(rows: list[OnloadRow], ratio: Callable[[OnloadRow], float]) -> Crossovers:
    codecs = dict.fromkeys(r.codec for r in rows)
    tiers = dict.fromkeys(r.tier for r in rows)
    return {codec: {tier: crossover([replace(r, speedup=ratio(r)) for r in rows if r.codec == codec], tier)
                    for tier in tiers} for codec in codecs}


def crossovers(rows: list[OnloadRow]) -> dict[str, Crossovers]:
    """Per codec and tier, the shortest history from which reloading wins at every longer one (None:
    recomputing wins at the longest): against recomputing the history (`history`), and for the
    whole visit, reload + cached visit against the full visit (`visit`)."""
    return {"history": _crossovers(rows, lambda r: r.speedup), "visit": _crossovers(rows, lambda r: r.visit_speedup)}
