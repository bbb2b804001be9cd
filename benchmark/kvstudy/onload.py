"""Onload: what a returning user's reload from each tier costs, against recomputing its history.

tier_benchmark's reload, per tier and history length: the user's L tokens are in the tier and not
on the device; `prepare_kv_cache` of one new token onloads them (tier `info` + `read` + the copy
into fresh device pages), then `rollback`. Medians of `repeats` rounds after a warm-up. The
recompute it is set against is the visits section's prefill of the same history, measured in
the same run; a visit served by a reload costs reload + cached visit, one by recompute the full
visit.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tier_benchmark import USER, TierFactory, cache_config, crossover, loaded_cache, tier_factories, time_reload
from tqdm import tqdm

from kvcache.local_redis import LocalRedisServer, redis_server_binary
from model.recommender import HSTURecommender

from .visits import VisitRow

REDIS_MISSING = "redis-server is not installed (and no --redis_url was given): the Redis tier is left out"


@dataclass(frozen=True)
class OnloadRow:
    tier: str
    history: int
    stored_bytes: int  # the user's bytes in the tier
    reload_ms: float
    recompute_ms: float  # the history's prefill
    speedup: float  # recompute / reload (> 1: reloading pays)
    visit_reload_ms: float  # reload + the cached visit
    visit_full_ms: float  # the full-recompute visit


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


def reload_ms(model: HSTURecommender, make_tier: TierFactory, history: int, repeats: int, device: torch.device) -> float:
    cache = loaded_cache(model.config, model.dtype, history, make_tier(history), device)
    try:
        time_reload(cache, history)  # warm-up
        return statistics.median(time_reload(cache, history) for _ in range(repeats)) * 1e3
    finally:
        cache.invalidate_kv_cache([USER])  # frees the tier's space (Redis keys, files)
        cache.close()
        cache.host_storage.close()  # built here: the manager does not own it


def measure_onload(model: HSTURecommender, tiers: list[str], visits: list[VisitRow], repeats: int,
                   workdir: Path, redis_url: str | None, device: torch.device) -> list[OnloadRow]:
    """Every tier in `tiers` at every history of `visits` (the Redis tier needs `redis_url`)."""
    longest = max(v.history for v in visits)
    layout = cache_config(model.config, model.dtype, longest).page_layout
    capacity = 2 * layout.num_pages(longest) * layout.page_nbytes  # every tier holds the user whole
    factories = tier_factories(tiers, workdir, redis_url, capacity)
    rows = []
    shapes = [(v, tier) for v in visits for tier in tiers]
    for visit, tier in tqdm(shapes, desc="onload: tiers x histories", leave=False):
        ms = reload_ms(model, factories[tier], visit.history, repeats, device)
        rows.append(OnloadRow(tier, visit.history, layout.num_pages(visit.history) * layout.page_nbytes, ms,
                              visit.prefill_ms, visit.prefill_ms / ms, ms + visit.cached_ms, visit.full_ms))
    return rows


def crossovers(rows: list[OnloadRow]) -> dict[str, int | None]:
    """Per tier: the shortest history from which reloading beats recomputing at every longer one."""
    return {tier: crossover(rows, tier) for tier in dict.fromkeys(r.tier for r in rows)}
