"""InferenceSession: serve whole visits, incrementally through a KV cache or by full recompute.

A visit:  get_user_residences (one lookup per user: its cache version and tier) -> plan (token layout)
          -> fetch only the uncached events -> prepare_kv_cache(expected_versions) -> forward
          -> commit (rollback on any failure) -> offload_kv_cache (unless `offload_between_visits` is off).
The cache's part is `serve_through_cache` (model/cached_serving.py).
Without a cache the same visit computes the user's whole window. Both paths plan their
window with the same pure function of the history end, so they attend over identical
tokens and their logits agree to round-off.

The session owns the cache transaction; the model only computes through the `PagedKV` it is
handed. Each prepare states the cache versions the session planned against (`expected_versions`:
range, tag and commit generation), so a cache changed by another caller in between, even to other
tokens of the same length, is refused and the visit re-planned, never served with a silently
restarted or rewritten window.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from data.batch import VisitBatch
from data.dataset import InferenceDataset
from data.user_histories import UserHistories
from kvcache import KVCacheManager
from model.cache_tag import window_tags
from model.cached_serving import BatchMaker, serve_through_cache
from model.checkpoint import model_fingerprint as fingerprint_of
from model.cuda_graphs import CUDAGraphs, use_cuda_graphs
from model.kv_store import KVStore
from model.recommender import HSTURecommender
from model.visit import Visit, VisitCache, check_visits, visit_caches

__all__ = ["HistorySource", "InferenceSession", "VisitResult", "serve_through_cache"]


@dataclass(frozen=True)
class VisitResult:
    request_ids: np.ndarray  # [B] (-1 for ad-hoc requests)
    user_ids: np.ndarray  # [B]
    history_lengths: np.ndarray  # [B] events in each user's history at the visit (its end)
    candidate_lengths: np.ndarray  # [B]
    logits: torch.Tensor  # [M, num_tasks] float32 on CPU, users in request order
    labels: torch.Tensor | None  # [M, num_tasks] float32 on CPU (None for ad-hoc requests)
    tokens_computed: int  # history tokens (prefix included) and candidates run through the model
    tokens_reused: int  # history tokens read from the KV cache instead
    caches: list[VisitCache]  # [B] each visit's plan: the tier its K/V came from, tokens reused / computed


class HistorySource(Protocol):
    """Where a session reads users' histories: a history store (history/base.py), or a preprocessed
    dataset (`InferenceDataset`: every user's logged events, read-only)."""

    def snapshot(self, user_ids: np.ndarray, until_ms: np.ndarray) -> UserHistories: ...


class InferenceSession:
    def __init__(
        self,
        model: HSTURecommender,
        history: HistorySource,
        kv_cache: KVCacheManager | None = None,
        offload_between_visits: bool = True,
        model_fingerprint: str | None = None,
        cuda_graphs: bool | None = False,
    ):
        """`model_fingerprint` (default: computed from the weights) goes into every cache tag,
        so K/V written by another model are never reused, in any tier. `cuda_graphs` runs each
        forward as the replay of its bucket's CUDA graph (model/cuda_graphs.py; True: CUDA only;
        None: wherever they can run, `use_cuda_graphs`)."""
        self.model = model.eval()
        graphs = use_cuda_graphs(cuda_graphs, model.device, model.resolved_attention_backend())
        self.graphs = CUDAGraphs(model) if graphs else None
        self.history = history
        self.dataset = history if isinstance(history, InferenceDataset) else None  # serve() replays its visits
        self.kv_cache = kv_cache
        self.offload_between_visits = offload_between_visits
        self.tag_mismatches = 0  # cached windows dropped because their inputs changed
        self._fingerprint = ""
        if kv_cache is not None:
            self._fingerprint = model_fingerprint or fingerprint_of(model)
            cfg, kv = model.config, kv_cache.config
            if (kv.num_layers, kv.num_heads, kv.head_dim) != (cfg.num_layers, cfg.num_heads, cfg.head_dim):
                raise ValueError(
                    f"KV cache shape (layers={kv.num_layers}, heads={kv.num_heads}, head_dim={kv.head_dim}) does "
                    f"not match the model (layers={cfg.num_layers}, heads={cfg.num_heads}, head_dim={cfg.head_dim})"
                )

    # ------------------------------------------------------------------ entry points
    def serve(self, request_indices: np.ndarray, next_request_indices: np.ndarray | None = None) -> VisitResult:
        """Score one batch of the dataset's visits (each of a different user) and update the cache.

        `next_request_indices` (the batch the caller serves next) are prefetched once this batch is
        prepared: their users' K/V move from the host tier to the device while this batch computes.
        """
        if self.dataset is None:
            raise TypeError("serve() replays a dataset's visits: this session reads a history store, use score()")
        idx = np.asarray(request_indices, dtype=np.int64).reshape(-1)
        requests = self.dataset.requests
        after_prepare = None if next_request_indices is None else lambda: self.prefetch(next_request_indices)
        return self._serve(
            requests.user_id[idx], requests.end[idx],
            lambda starts, windows: self.dataset.make_batch(idx, starts, windows), self.dataset, after_prepare,
        )

    def prefetch(self, request_indices: np.ndarray) -> int:
        """Start onloading the users of these visits that only a host tier holds and whose visit continues
        what is cached (`KVCacheManager.prefetch`); returns how many. Serving them later gives the same
        results as without it; no-op without a cache."""
        if self.kv_cache is None:
            return 0
        idx = np.asarray(request_indices, dtype=np.int64).reshape(-1)
        users = self.dataset.requests.user_id[idx]
        cached_start, cached_len = self.kv_cache.get_user_kvdata_info(users.tolist())
        plan = self.model.layout.plan(self.dataset.requests.end[idx], cached_start.numpy(), cached_len.numpy())
        reusing = plan.starts > plan.window_starts  # a window that restarts would drop what is onloaded
        return self.kv_cache.prefetch(users[reusing].tolist())

    def score(self, visits: Sequence[Visit]) -> VisitResult:
        """Score visits (each of a different user) over the users' histories at their request times.

        Each visit's `new_events` are appended to the history store first (all of them, durably, in one
        append), then every visit is scored over its user's stored events strictly before its time.
        Raises a ValueError naming the visit and field for a visit with no events before its time, an
        empty or negative candidate list, or new events of another user; nothing is stored then.
        """
        new_events = check_visits(visits)
        if new_events is not None:
            append = getattr(self.history, "append", None)
            if append is None:
                raise TypeError(f"visits carry new events but {type(self.history).__name__} is read-only")
            append(new_events)
        users = np.array([int(v.user_id) for v in visits], dtype=np.int64)
        times = np.array([int(v.request_time_ms) for v in visits], dtype=np.int64)
        return self.score_over(self.history.snapshot(users, times), visits)

    def score_over(self, histories: UserHistories, visits: Sequence[Visit]) -> VisitResult:
        """`score` over histories already read (a snapshot of the visits' users); new events are not stored."""
        check_visits(visits)
        users = np.array([int(v.user_id) for v in visits], dtype=np.int64)
        times = np.array([int(v.request_time_ms) for v in visits], dtype=np.int64)
        ends = histories.history_ends(users, times)
        if not (ends > 0).all():
            b = int(np.flatnonzero(ends == 0)[0])
            raise ValueError(f"visits[{b}] (user {int(users[b])}): no events before request_time_ms={int(times[b])}")
        candidates = [np.asarray(v.candidate_video_ids, dtype=np.int64).reshape(-1) for v in visits]
        lengths = np.array([len(c) for c in candidates], dtype=np.int64)
        flat = np.concatenate(candidates)
        return self._serve(
            users, ends,
            lambda starts, windows: histories.make_request_batch(users, ends, starts, windows, times, lengths, flat),
            histories,
        )

    # ------------------------------------------------------------------ one batch
    def _serve(
        self, user_ids: np.ndarray, ends: np.ndarray, make_batch: BatchMaker, histories: UserHistories,
        after_prepare: Callable | None = None,
    ) -> VisitResult:
        if len(np.unique(user_ids)) != len(user_ids):
            raise ValueError("A batch may hold each user at most once (later visits depend on earlier ones)")
        layout = self.model.layout
        residences = None
        if self.kv_cache is None:
            windows = layout.window_start(ends)
            batch = make_batch(windows, windows)
            with torch.inference_mode():
                logits = self._forward(batch, None)
            reused = 0
        else:
            served = self._serve_cached(user_ids, ends, make_batch, histories, after_prepare)
            batch, logits, reused, residences = served.batch, served.logits, served.tokens_reused, served.residences
            if self.offload_between_visits:
                self.kv_cache.offload_kv_cache(user_ids.tolist())
        spans = layout.spans(batch.window_starts, batch.starts, batch.history_lengths)
        page_size, page_nbytes = ((self.kv_cache.config.page_size, self.kv_cache.config.page_layout.page_nbytes)
                                  if self.kv_cache is not None else (1, 0))
        caches = visit_caches(layout, ends, residences, spans.expected_cached_lengths,
                              spans.history_lengths + batch.candidate_lengths, page_size, page_nbytes)
        return VisitResult(
            request_ids=batch.request_ids,
            user_ids=batch.user_ids,
            history_lengths=batch.ends,
            candidate_lengths=batch.candidate_lengths,
            logits=logits.float().cpu(),
            labels=None if batch.labels is None else torch.from_numpy(batch.labels),
            tokens_computed=int(spans.history_lengths.sum() + batch.candidate_lengths.sum()),
            tokens_reused=reused,
            caches=caches,
        )

    def _forward(self, batch: VisitBatch, kv: KVStore | None) -> torch.Tensor:
        if self.graphs is None:
            return self.model(batch, kv)
        return self.graphs.run(self.model.prepare_inputs(batch, kv, bucketed=True), kv)

    def _prepared(self, prefetch: Callable | None) -> None:
        """Once a batch is prepared (its onloads issued), before its forward."""
        if self.graphs is not None:
            # A replay reads the pool without asking k_cache(), so its stream waits for every onload issued
            # so far, on the device, here: before the next batch's prefetch issues its own, which the replay
            # must not wait for (they overlap it).
            self.kv_cache.wait_for_onloads()
        if prefetch is not None:
            prefetch()

    def _serve_cached(self, user_ids: np.ndarray, ends: np.ndarray, make_batch: BatchMaker, histories: UserHistories,
                      after_prepare):
        def tags(users: np.ndarray, window_starts: np.ndarray, window_ends: np.ndarray) -> list[bytes]:
            return window_tags(self._fingerprint, self.model.config.num_prefix_tokens, histories, users,
                               window_starts, window_ends)

        served = serve_through_cache(
            self.model, self.kv_cache, user_ids, ends, make_batch, tags, forward=self._forward,
            after_prepare=lambda: self._prepared(after_prepare),
        )
        self.tag_mismatches += served.tag_mismatches
        return served
