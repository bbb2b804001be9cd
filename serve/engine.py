"""A node's scoring: checked queries -> `InferenceSession.score_over`, and where each visit's K/V came from.

The engine owns the node's model, its history source and KV cache. The history source is a history
store (history/: events arrive live through POST /events or inline in /score, every node reads the
same store) or a preprocessed dataset served read-only (a replay). A request names a user and a
time; the user's events before that time are read from the source, once per batch for every visit
of the batch. Scoring runs on one thread (the node's compute thread); `validate` is cheap and runs
on the event loop.

Per visit it reports what a capacity planner and the router's evaluation need: the tier the
reused K/V came from (this node's device or host memory, the shared Redis tier, or none), the
tokens reused, computed and *recomputed* (history tokens the visit computed although a tier
this node can see held them: a stale copy on the device while the shared tier held more), and
the bytes reloaded from the shared tier. The session returns them with the logits
(`VisitResult.caches`): each visit is planned once, from one lookup of its user in the cache.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data.dataset import InferenceDataset
from data.user_histories import UserHistories
from history.base import HistoryStore, HistoryUnavailableError
from history.registry import open_history_store
from kvcache import (
    CacheEvent,
    CacheEventListener,
    HostKVStorage,
    KVCacheCapacityError,
    KVCacheConfig,
    KVCacheManager,
    KVCacheRequestError,
    build_host_storage,
)
from model.cache_config import kv_cache_config, window_pages
from model.checkpoint import CheckpointError, load_checkpoint, model_fingerprint
from model.inference import HistorySource, InferenceSession
from model.recommender import HSTURecommender
from model.visit import Visit, VisitCache
from model.warm_up import WarmUpReport, warm_up
from serve.protocol import RequestError, ScoreQuery, unprocessable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    data_dir: str | None  # a preprocessed dataset served read-only (when no history_store)
    checkpoint: str
    history_store: str | None = None  # a history store URL (history/registry.py): live events
    # The cache's settings default to the cache's own defaults (KVCacheConfig: their one home).
    device: str = KVCacheConfig.device
    kv_pages: int = KVCacheConfig.num_pages  # device pool pages (at least one largest window)
    page_size: int | None = None  # None: the model's
    host_capacity_bytes: int = KVCacheConfig.host_capacity_bytes
    redis_url: str | None = None  # the shared tier (and the locality index); None: this node alone
    redis_capacity_bytes: int = KVCacheConfig.redis_capacity_bytes
    kv_codec: str = KVCacheConfig.kv_codec  # how the host tiers and Redis store K/V pages (kvcache/codecs/registry.py)
    async_offload: bool = True
    offload_each_visit: bool = True  # write each visit's K/V through to the host tiers (and Redis)
    max_candidates: int = 512
    cuda_graphs: bool | None = None  # serve through CUDA graphs; None: on CUDA (model/cuda_graphs.use_cuda_graphs)


@dataclass(frozen=True)
class EngineResult:
    logits: list[list[float]]  # [candidates][tasks]
    history_length: int
    cache: VisitCache


class CacheLocations:
    """The cache's event listener: passes the events on to its subscribers (the locality index's
    publisher), which may come after the cache is built. Runs under the cache's lock."""

    def __init__(self) -> None:
        self._subscribers: list[CacheEventListener] = []

    def subscribe(self, listener: CacheEventListener) -> None:
        self._subscribers.append(listener)

    def __call__(self, events: list[CacheEvent]) -> None:
        for listener in self._subscribers:
            listener(events)


class ScoringEngine:
    def __init__(
        self,
        model: HSTURecommender,
        history: HistorySource,
        cache: KVCacheManager,
        storage: HostKVStorage,
        locations: CacheLocations,
        config: EngineConfig,
        fingerprint: str | None = None,
    ) -> None:
        self.model = model
        self.history = history
        self.store = history if isinstance(history, HistoryStore) else None  # takes new events
        self.cache = cache
        self.storage = storage
        self.config = config
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.locations = locations
        self.session = InferenceSession(
            model, history, kv_cache=cache, model_fingerprint=self.fingerprint,
            offload_between_visits=config.offload_each_visit, cuda_graphs=config.cuda_graphs,
        )
        self.warm_up_report: WarmUpReport | None = None  # set by warm_up(), before the node reports ready

    # ------------------------------------------------------------------ checks (event loop thread)
    def validate(self, query: ScoreQuery) -> None:
        """Refuse (RequestError 422) what needs no history read, before the query is queued; a visit's
        history is checked in its batch (`score_batch` answers unknown_user / no_history per visit)."""
        if query.events is not None and self.store is None:
            raise RequestError(405, "read_only_history",
                               "this node serves a fixed dataset (no --history_store): it takes no events")
        if len(query.candidate_video_ids) > self.config.max_candidates:
            raise unprocessable(
                "too_many_candidates",
                f"user {query.user_id}: {len(query.candidate_video_ids)} candidate_video_ids, "
                f"at most {self.config.max_candidates} per request",
            )

    # ------------------------------------------------------------------ scoring (compute thread)
    def score_batch(self, queries: Sequence[ScoreQuery]) -> list[EngineResult | RequestError]:
        """Score a batch (each user at most once), reading the users' histories once. A visit that cannot
        be scored gets its own error; the others are scored. A batch whose windows do not fit the device
        pool together, that the cache refuses, or whose forward fails, is served one visit at a time
        (`_score_alone`), so that only the visit at fault gets an error."""
        users = np.array([q.user_id for q in queries], dtype=np.int64)
        times = np.array([q.request_time_ms for q in queries], dtype=np.int64)
        try:
            histories = self.history.snapshot(users, times)
        except HistoryUnavailableError as err:
            return [RequestError(503, "history_unavailable", str(err))] * len(queries)
        out: list[EngineResult | RequestError | None] = [None] * len(queries)
        known = np.isin(users, histories.user_ids)
        ends = np.zeros(len(users), dtype=np.int64)
        ends[known] = histories.history_ends(users[known], times[known])
        for b in np.flatnonzero(ends == 0).tolist():
            q = queries[b]
            out[b] = (unprocessable("unknown_user", f"user {q.user_id} has no events in {histories.where}")
                      if not known[b] else
                      unprocessable("no_history", f"user {q.user_id} has no events before request_time_ms={q.request_time_ms}"))
        scored = np.flatnonzero(ends > 0)
        if len(scored):
            for b, result in zip(scored.tolist(), self._score(histories, [queries[b] for b in scored], ends[scored])):
                out[b] = result
        return out

    def _score(self, histories: UserHistories, queries: list[ScoreQuery], ends: np.ndarray
               ) -> list[EngineResult | RequestError]:
        if len(queries) == 1:
            return [self._score_alone(histories, queries[0], ends)]
        try:
            return self._score_together(histories, queries, ends)
        except KVCacheRequestError as err:  # capacity, or one user's cache at odds with its visit
            log.warning("a batch of %d visits was refused by the KV cache (%s): serving it one visit at a time",
                        len(queries), err)
        except Exception as err:  # one visit the model cannot take must not fail its batch-mates
            log.warning("a batch of %d visits failed (%s: %s): serving it one visit at a time",
                        len(queries), type(err).__name__, err)
        return [self._score_alone(histories, q, ends[b:b + 1]) for b, q in enumerate(queries)]

    def _score_alone(self, histories: UserHistories, query: ScoreQuery, ends: np.ndarray) -> EngineResult | RequestError:
        """One visit. A cache that refuses it (other than for room) is dropped for the user and the visit
        computed from the history once more: K/V is derived from events, so that is always right. Any
        other failure is this visit's answer (500 scoring_failed); a failed forward leaves the cache
        as it was (model/cached_serving.py rolls it back)."""
        try:
            return self._score_together(histories, [query], ends)[0]
        except KVCacheCapacityError:
            raise
        except KVCacheRequestError as err:
            log.warning("user %d: the KV cache refused the visit (%s); recomputing it from the history", query.user_id, err)
            self.cache.invalidate_kv_cache([query.user_id])
        except Exception as err:
            return _scoring_failed(query, err)
        try:
            return self._score_together(histories, [query], ends)[0]
        except KVCacheCapacityError:
            raise
        except KVCacheRequestError as err:
            return RequestError(500, "kv_cache_error", f"user {query.user_id}: {err}")
        except Exception as err:
            return _scoring_failed(query, err)

    def _score_together(self, histories: UserHistories, queries: list[ScoreQuery], ends: np.ndarray) -> list[EngineResult]:
        visits = [Visit(q.user_id, q.request_time_ms, np.asarray(q.candidate_video_ids, dtype=np.int64)) for q in queries]
        result = self.session.score_over(histories, visits)
        logits = result.logits.numpy()
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        return [
            EngineResult(logits[offsets[b]:offsets[b + 1]].tolist(), int(ends[b]), result.caches[b])
            for b in range(len(queries))
        ]

    # ------------------------------------------------------------------ lifecycle
    def warm_up(self) -> WarmUpReport:
        """Run every attention kernel variant this node can meet (model/warm_up.py), so that no JIT compile
        lands on a request, the way this node serves (its CUDA graphs included); GET /health reports it."""
        self.warm_up_report = warm_up(self.model, [self.cache.config], cuda_graphs=self.session.graphs is not None)
        return self.warm_up_report

    def reset_cache(self) -> None:
        """Forget every user's K/V in every tier, the shared one included (a benchmark's fresh start)."""
        self.cache.wait()
        users = self.store.stored_user_ids() if self.store is not None else self.history.user_ids
        self.cache.invalidate_kv_cache(users.tolist())

    def shutdown(self) -> None:
        """Offload every user's device K/V to the host tiers (the shared one included) and close them."""
        try:
            self.cache.offload_kv_cache()
            self.cache.wait()
        finally:
            self.cache.close()
            self.storage.close()
            if self.store is not None:
                self.store.close()


def _scoring_failed(query: ScoreQuery, err: Exception) -> RequestError:
    log.exception("user %d: scoring the visit at request_time_ms=%d failed", query.user_id, query.request_time_ms,
                  exc_info=err)
    return RequestError(500, "scoring_failed", f"user {query.user_id}: {type(err).__name__}: {err}")


def open_engine(config: EngineConfig) -> ScoringEngine:
    """Open the history source and the checkpoint and build the cache the config describes."""
    model = load_checkpoint(config.checkpoint, device=config.device).model
    if config.history_store is not None:
        history = open_history_store(config.history_store)
        manifest, where = history.get_manifest(), history.description
        if manifest is None and model.config.use_contextual_prefix:
            history.close()
            raise CheckpointError(f"{where} was never bootstrapped (python -m history.bootstrap): the user-feature "
                                  f"vocabularies {config.checkpoint} was trained with are unknown to it")
        if history.retention is not None:  # every window the model reads must lie within the kept events
            try:
                history.retention.check_model(model.config)
            except ValueError:
                history.close()
                raise
    else:
        if config.data_dir is None:
            raise ValueError("a node needs a history store (history_store) or a preprocessed dataset (data_dir)")
        history = InferenceDataset(config.data_dir)
        manifest, where = history.manifest, config.data_dir
        history.counters()  # every batch carries the counting features: build their indexes now, not on a request
    features = manifest.user_feature_cardinalities if manifest is not None else ()
    if model.config.use_contextual_prefix and model.config.user_feature_cardinalities != features:
        raise CheckpointError(
            f"{config.checkpoint} was trained for user-feature vocabularies {list(model.config.user_feature_cardinalities)}, "
            f"the data in {where} has {list(features)}"
        )
    fingerprint = model_fingerprint(model)
    page_size = config.page_size or model.config.page_size
    full_window = window_pages(model.config, page_size)
    if config.kv_pages < full_window:
        raise ValueError(f"kv_pages={config.kv_pages} cannot hold one full window ({full_window} pages of {page_size} tokens)")
    kv_config = kv_cache_config(
        model.config, num_pages=config.kv_pages, page_size=page_size, device=config.device,
        host_capacity_bytes=config.host_capacity_bytes, async_offload=config.async_offload, redis_url=config.redis_url,
        redis_namespace=fingerprint if config.redis_url else "", redis_capacity_bytes=config.redis_capacity_bytes,
        kv_codec=config.kv_codec,
    )
    storage = build_host_storage(kv_config)
    locations = CacheLocations()
    try:
        cache = KVCacheManager(kv_config, host_storage=storage, event_listener=locations)
    except BaseException:
        storage.close()
        raise
    try:
        return ScoringEngine(model, history, cache, storage, locations, config, fingerprint)
    except BaseException:  # e.g. cuda_graphs asked for where they cannot run
        cache.close()
        storage.close()
        raise

