"""InferenceSession: serve whole visits, incrementally through a KV cache or by full recompute.

A visit:  get_user_kvdata_info -> plan (token layout) -> fetch only the uncached events
          -> forward (prepare, append, attend, commit) -> offload_kv_cache.
Without a cache the same visit computes the user's whole window. Both paths plan their
window with the same pure function of the history end, so they attend over identical
tokens and their logits agree to round-off.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from data.dataset import InferenceDataset
from kvcache import KVCacheManager, KVCacheStaleError
from model.cache_tag import window_tag
from model.checkpoint import model_fingerprint as fingerprint_of
from model.recommender import HSTURecommender, StaleKVCacheError
from model.token_layout import TokenLayout, VisitPlan

log = logging.getLogger(__name__)

MAX_PLAN_ATTEMPTS = 3  # data lost between planning and prepare (another caller's eviction) is re-planned


@dataclass(frozen=True)
class VisitResult:
    request_ids: np.ndarray  # [B]
    user_ids: np.ndarray  # [B]
    history_lengths: np.ndarray  # [B] events in each user's history at the visit (its end)
    candidate_lengths: np.ndarray  # [B]
    logits: torch.Tensor  # [M, num_tasks] float32 on CPU
    labels: torch.Tensor  # [M, num_tasks] float32 on CPU
    tokens_computed: int  # history tokens (prefix included) and candidates run through the model
    tokens_reused: int  # history tokens read from the KV cache instead


class InferenceSession:
    def __init__(
        self,
        model: HSTURecommender,
        dataset: InferenceDataset,
        kv_cache: KVCacheManager | None = None,
        offload_between_visits: bool = True,
        model_fingerprint: str | None = None,
    ):
        """`model_fingerprint` (default: computed from the weights) goes into every cache tag,
        so K/V written by another model are never reused, in any tier."""
        self.model = model.eval()
        self.dataset = dataset
        self.kv_cache = kv_cache
        self.offload_between_visits = offload_between_visits
        self.tag_mismatches = 0  # cached windows dropped because their inputs changed
        self._fingerprint = ""
        if kv_cache is not None:
            self._fingerprint = model_fingerprint or fingerprint_of(model)
        if kv_cache is not None:
            cfg, kv = model.config, kv_cache.config
            if (kv.num_layers, kv.num_heads, kv.head_dim) != (cfg.num_layers, cfg.num_heads, cfg.head_dim):
                raise ValueError(
                    f"KV cache shape (layers={kv.num_layers}, heads={kv.num_heads}, head_dim={kv.head_dim}) does "
                    f"not match the model (layers={cfg.num_layers}, heads={cfg.num_heads}, head_dim={cfg.head_dim})"
                )

    def serve(self, request_indices: np.ndarray) -> VisitResult:
        """Score one batch of visits (each of a different user) and update the cache."""
        requests = self.dataset.requests
        request_indices = np.asarray(request_indices, dtype=np.int64)
        user_ids = requests.user_id[request_indices]
        ends = requests.end[request_indices]
        if len(np.unique(user_ids)) != len(user_ids):
            raise ValueError("A batch may hold each user at most once (later visits depend on earlier ones)")

        for attempt in range(1, MAX_PLAN_ATTEMPTS + 1):
            plan = plan_visits(self.model.layout, self.kv_cache, user_ids, ends)
            tags = None
            if self.kv_cache is not None:
                plan = self._drop_mismatched_tags(plan, user_ids)
                tags = [self._tag(u, w, e) for u, w, e in zip(user_ids.tolist(), plan.window_starts.tolist(), ends.tolist())]
            batch = self.dataset.make_batch(request_indices, plan.starts, plan.window_starts).to(self.model.device)
            try:
                with torch.inference_mode():
                    logits = self.model(batch, self.kv_cache, cache_tags=tags)
                break
            except (StaleKVCacheError, KVCacheStaleError) as err:
                if attempt == MAX_PLAN_ATTEMPTS:
                    raise
                log.warning("re-planning a visit: %s", err)

        if self.kv_cache is not None and self.offload_between_visits:
            self.kv_cache.offload_kv_cache(user_ids.tolist())

        spans = self.model.layout.spans(batch.window_starts, batch.starts, batch.history_lengths)
        return VisitResult(
            request_ids=requests.request_id[request_indices],
            user_ids=user_ids,
            history_lengths=ends,
            candidate_lengths=batch.candidate_lengths.cpu().numpy(),
            logits=logits.float().cpu(),
            labels=batch.labels.cpu(),
            tokens_computed=int(spans.history_lengths.sum() + batch.candidate_lengths.sum()),
            tokens_reused=int(spans.expected_cached_lengths.sum()),
        )

    def _tag(self, user_id: int, window_start: int, end: int) -> bytes:
        events = self.dataset.user_events(user_id, window_start, end)
        return window_tag(self._fingerprint, window_start, self.model.config.num_prefix_tokens, events)

    def _drop_mismatched_tags(self, plan: VisitPlan, user_ids: np.ndarray) -> VisitPlan:
        """Continue a cached window only if its tag matches the events it claims to hold."""
        reusing = np.flatnonzero(plan.starts > plan.window_starts)
        if len(reusing) == 0:
            return plan
        stored = self.kv_cache.get_user_tags(user_ids[reusing].tolist())
        stale = [i for i, tag in zip(reusing.tolist(), stored)
                 if tag != self._tag(int(user_ids[i]), int(plan.window_starts[i]), int(plan.starts[i]))]
        if not stale:
            return plan
        self.tag_mismatches += len(stale)
        log.warning("recomputing %d user(s) whose cached K/V do not match their history", len(stale))
        self.kv_cache.invalidate_kv_cache(user_ids[stale].tolist())
        starts = plan.starts.copy()
        starts[stale] = plan.window_starts[stale]
        return VisitPlan(plan.window_starts, starts, invalidate=plan.invalidate)


def plan_visits(layout: TokenLayout, kv_cache: KVCacheManager | None, user_ids: np.ndarray, ends: np.ndarray) -> VisitPlan:
    """What each visit must compute: the whole window without a cache; with one, the events
    after what the cache holds for this window (a cache holding anything else is dropped)."""
    if kv_cache is None:
        windows = layout.window_start(ends)
        return VisitPlan(windows, windows, invalidate=np.zeros(len(ends), dtype=bool))
    cached_start, cached_len = kv_cache.get_user_kvdata_info(np.asarray(user_ids).tolist())
    plan = layout.plan(ends, cached_start.cpu().numpy(), cached_len.cpu().numpy())
    if plan.invalidate.any():
        # The window moved on (or the cache holds something else): start it afresh.
        kv_cache.invalidate_kv_cache(np.asarray(user_ids)[plan.invalidate].tolist())
    return plan
