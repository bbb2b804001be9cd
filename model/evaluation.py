"""Scoring a model on a set of visits, and the holdout bookkeeping of training (early stopping).

Scoring runs the serving forward (`HSTURecommender.forward`, full recompute) over each visit's
window, batched like the trainer; candidates come back in request order, so every scorer of the
same requests (model/baselines/) lines up row by row.
"""
from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.batch import VisitBatch
from data.dataset import InferenceDataset
from model.recommender import HSTURecommender


def window_starts(model: HSTURecommender, ends: np.ndarray, max_history_events: int | None = None) -> np.ndarray:
    """[B] event index where each visit's window starts: the model's own window (what serving uses),
    or, with `max_history_events`, its last that many events at most (a training-time crop; token
    encodings do not depend on where a window starts, so a cropped visit embeds its events as serving does)."""
    starts = model.layout.window_start(ends)
    if max_history_events is not None:
        starts = np.maximum(starts, np.asarray(ends, dtype=np.int64) - max_history_events)
    return starts


def window_batch(
    model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray, max_history_events: int | None = None,
    history_targets: int = 0,
) -> VisitBatch:
    """The full-recompute batch of requests `indices`: each visit carries its whole window (and, for
    training, its last `history_targets` events as targets too: `InferenceDataset.make_batch`)."""
    starts = window_starts(model, dataset.requests.end[indices], max_history_events)
    return dataset.make_batch(indices, starts, starts, history_targets=history_targets)


@dataclass(frozen=True)
class ScoredCandidates:
    """Every candidate of some requests, in request order ([M] rows)."""

    logits: np.ndarray  # [M, num_tasks] float32
    labels: np.ndarray  # [M, num_tasks] float32

    def mean_bce(self) -> float:
        """Mean binary cross-entropy over candidates and tasks (what training minimises)."""
        if self.logits.size == 0:
            return float("nan")
        loss = F.binary_cross_entropy_with_logits(torch.from_numpy(self.logits), torch.from_numpy(self.labels))
        return float(loss)


def score_requests(
    model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray, batch_size: int,
    desc: str = "score", progress: bool = True, kv_cache: bool = False,
    max_history_events: int | None = None, edit_batch: Callable[[VisitBatch], VisitBatch] | None = None,
) -> ScoredCandidates:
    """The model's logits for every candidate of `indices` (inference mode).

    Full recompute of each visit's window by default; with `kv_cache`, through an
    `InferenceSession` over a KV cache (the same logits to fp32 round-off, by the parity
    contract, and much faster for many visits per user in time order). A full recompute may
    crop each window to its last `max_history_events` events, and `edit_batch` may rewrite each
    batch before it is scored (model/order_ablation.py's variants)."""
    if kv_cache and (max_history_events is not None or edit_batch is not None):
        raise ValueError("max_history_events and edit_batch apply to full recompute only, not kv_cache")
    logits, labels = [], []
    was_training = model.training
    model.eval()
    batches = list(dataset.batches(indices, batch_size))
    session = _cached_session(model, dataset, batch_size) if kv_cache else None
    with torch.inference_mode():
        for idx in tqdm(batches, desc=desc, leave=False, file=sys.stderr, disable=not progress):
            if session is not None:
                result = session.serve(idx)
                logits.append(result.logits.float().cpu().numpy())
                labels.append(result.labels.cpu().numpy())
                continue
            batch = window_batch(model, dataset, idx, max_history_events)
            if edit_batch is not None:
                batch = edit_batch(batch)
            logits.append(model(batch).float().cpu().numpy())
            labels.append(batch.labels)
    model.train(was_training)
    num_tasks = model.config.num_tasks
    if not logits:
        return ScoredCandidates(np.zeros((0, num_tasks), np.float32), np.zeros((0, num_tasks), np.float32))
    return ScoredCandidates(np.concatenate(logits), np.concatenate(labels))


def _cached_session(model: HSTURecommender, dataset: InferenceDataset, batch_size: int):
    """A session over a KV cache whose device pool holds a full batch of the largest windows."""
    from kvcache import KVCacheManager
    from model.cache_config import kv_cache_config, window_pages
    from model.inference import InferenceSession

    cache = KVCacheManager(kv_cache_config(
        model.config, num_pages=batch_size * window_pages(model.config), dtype=model.dtype, device=model.device,
    ))
    return InferenceSession(model, dataset, kv_cache=cache)


@dataclass
class EarlyStopping:
    """Keeps the parameters of the epoch with the lowest holdout score (a loss, or 1 - an AUC); says
    stop after `patience` epochs without a new best."""

    patience: int
    best_score: float = float("inf")
    best_epoch: int = -1
    epochs_without_improvement: int = 0
    best_state: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")

    def update(self, epoch: int, score: float, model: torch.nn.Module) -> bool:
        """Record one epoch's holdout score (lower is better); True when training should stop."""
        if score < self.best_score:
            self.best_score, self.best_epoch, self.epochs_without_improvement = score, epoch, 0
            self.best_state = copy.deepcopy(model.state_dict())
        else:
            self.epochs_without_improvement += 1
        return self.epochs_without_improvement >= self.patience

    def restore_best(self, model: torch.nn.Module) -> None:
        if self.best_state is not None:
            model.load_state_dict(self.best_state)
