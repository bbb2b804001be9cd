"""One batch of visits through the KV cache: plan against the cache, prepare, forward, commit.

`serve_through_cache` is the cache transaction `InferenceSession` runs for a batch (model/inference.py):
each prepare states the cache versions the plan stood on, so a cache changed by another caller in
between is refused and the visit re-planned; any failure rolls the batch back.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from data.batch import VisitBatch
from kvcache import CacheVersion, KVCacheManager, KVCacheStaleError
from kvcache.cache_version import NOTHING, Residence
from model.kv_store import KVStore, PagedKV
from model.recommender import HSTURecommender
from model.token_layout import VisitPlan

log = logging.getLogger(__name__)

MAX_PLAN_ATTEMPTS = 3  # a cache changed by another caller between planning and prepare is re-planned
BatchMaker = Callable[[np.ndarray, np.ndarray], VisitBatch]  # (starts, window_starts) -> batch


TagFn = Callable[[np.ndarray, np.ndarray, np.ndarray], list[bytes]]  # (user_ids, window_starts, ends) -> tags
Forward = Callable[[VisitBatch, KVStore | None], torch.Tensor]  # (batch, kv) -> logits


@dataclass(frozen=True)
class CachedVisits:
    batch: VisitBatch
    logits: torch.Tensor  # [M, num_tasks] on the model's device
    tokens_reused: int
    tag_mismatches: int
    residences: list[Residence]  # [B] what each visit was planned against


def serve_through_cache(
    model: HSTURecommender,
    cache: KVCacheManager,
    user_ids: np.ndarray,
    ends: np.ndarray,
    make_batch: BatchMaker,
    tags: TagFn | None = None,
    forward: Forward | None = None,
    after_prepare: Callable[[], object] | None = None,
) -> CachedVisits:
    """One batch of visits through the cache: plan, prepare (guarded by what was planned), forward,
    commit; rollback on any failure; re-plan when another caller changed the cache in between.

    `tags(user_ids, window_starts, ends)` describes the inputs of cached windows: a cached window
    whose stored tag differs is recomputed (None: tags are neither checked nor stored). `forward`
    replaces `model(batch, kv)` (e.g. a CUDA graph replay). `after_prepare()` runs once the batch is
    prepared, before its forward (a prefetch of the next batch overlaps this one's compute).
    """
    layout, users = model.layout, user_ids.tolist()
    forward = forward or model
    for attempt in range(1, MAX_PLAN_ATTEMPTS + 1):
        plan, mismatches, versions, residences = _plan(layout, cache, user_ids, ends, tags)
        batch = make_batch(plan.starts, plan.window_starts)
        behind = _reads_behind_cache(batch, plan) if cache.config.read_window is not None else None
        if behind is not None and behind.any():
            log.warning("recomputing %d user(s) whose candidates read history before the cached end", behind.sum())
            plan = _recompute(cache, user_ids, plan, behind, versions)
            batch = make_batch(plan.starts, plan.window_starts)
        spans = layout.spans(batch.window_starts, batch.starts, batch.history_lengths)
        try:
            meta = cache.prepare_kv_cache(
                users, spans.start_pos, spans.history_lengths,
                tags=None if tags is None else tags(user_ids, plan.window_starts, ends),
                expected_versions=versions,
            )
        except KVCacheStaleError as err:
            if attempt == MAX_PLAN_ATTEMPTS:
                raise
            log.warning("re-planning a visit: %s", err)
            continue
        try:
            if after_prepare is not None:
                after_prepare()
            with torch.inference_mode():
                logits = forward(batch, PagedKV(cache, meta))
        except BaseException:
            cache.rollback(meta)
            raise
        cache.commit(meta)
        return CachedVisits(batch, logits, int(spans.expected_cached_lengths.sum()), mismatches, residences)
    raise AssertionError("unreachable")


def _plan(layout, cache: KVCacheManager, user_ids: np.ndarray, ends: np.ndarray, tags: TagFn | None
          ) -> tuple[VisitPlan, int, list[CacheVersion], list[Residence]]:
    """What each visit computes: the events after what the cache holds for this window, when the
    cached data is exactly this window's first tokens (and carries the tag of their events);
    otherwise the cached data is dropped and the window computed from its start. Also the cache
    versions the plan stands on, for the prepare to check (a same-length rewrite included)."""
    residences = cache.get_user_residences(user_ids.tolist())
    versions = [r.version for r in residences]
    cached_start = np.array([v.start_pos for v in versions], dtype=np.int64)
    cached_len = np.array([v.length for v in versions], dtype=np.int64)
    plan = layout.plan(ends, cached_start, cached_len)
    drop = plan.invalidate.copy()
    reusing = np.flatnonzero(plan.starts > plan.window_starts)
    mismatches = 0
    if tags is not None and len(reusing):
        expected = tags(user_ids[reusing], plan.window_starts[reusing], plan.starts[reusing])
        stale = reusing[[versions[i].tag != e for i, e in zip(reusing, expected)]]
        if len(stale):
            mismatches = len(stale)
            log.warning("recomputing %d user(s) whose cached K/V do not match their history", mismatches)
            drop[stale] = True
    if drop.any():
        plan = _recompute(cache, user_ids, plan, drop, versions)
    return plan, mismatches, versions, residences


def _recompute(cache: KVCacheManager, user_ids: np.ndarray, plan: VisitPlan, drop: np.ndarray,
               versions: list[CacheVersion]) -> VisitPlan:
    """`plan` with the `drop` users' cached data invalidated and their windows computed from the start."""
    dropped = np.flatnonzero(drop)
    cache.invalidate_kv_cache(user_ids[dropped].tolist())
    for i in dropped:  # planned from nothing: whatever another caller caches meanwhile makes the prepare stale
        versions[i] = NOTHING
    return VisitPlan(plan.window_starts, np.where(drop, plan.window_starts, plan.starts), invalidate=plan.invalidate | drop)


def _reads_behind_cache(batch: VisitBatch, plan: VisitPlan) -> np.ndarray:
    """[B] bool: visits continuing cached data with a candidate that sees history ending before the cached
    end. A cache with a read window (kvcache/read_window.py) may hold zeros for the keys that candidate
    reads, which no query at or after the cached end reads."""
    if batch.candidate_history_ends is None:
        return np.zeros(batch.batch_size, dtype=bool)
    visit = np.repeat(np.arange(batch.batch_size), batch.candidate_lengths)
    early = batch.candidate_history_ends < plan.starts[visit]
    reusing = plan.starts > plan.window_starts
    return reusing & (np.bincount(visit[early], minlength=batch.batch_size) > 0)
