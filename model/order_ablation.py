"""Does a model read the history it is given? Score the same visits with their history as logged,
shuffled, cut to its last events, and removed, and compare.

    result = order_ablation(model, dataset, indices, batch_size=8, last_k=(1, 16), seed=0)
    result.variants["shuffled"].click_auc, result.variants["shuffled"].mean_abs_delta

Variants (full recompute of each visit's window):

    as logged      the window as served
    shuffled       the window's events (video id and action bits) permuted at random within each
                   window; their timestamps, positions and time features stay where they were
    last K         the window cut to its last K events (K = 0: no event at all; the contextual prefix
                   and the candidate-only terms, which read the user's counters, remain)

For each: per-task AUC, the change of click AUC against "as logged" with a paired bootstrap
interval over the users (model/auc_interval.py), and the mean |Δ logit| against "as logged"
(click), beside the spread (std) of the logged click logits. A model whose scores hardly move when its history is shuffled or
removed does not use the history, and a KV cache of that history buys it nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from data.batch import VisitBatch
from data.dataset import InferenceDataset
from data.schema import TASKS
from model.auc_interval import PairedInterval, paired_auc_difference
from model.evaluation import ScoredCandidates, score_requests
from model.metrics import per_task_auc
from model.quality import candidate_users
from model.recommender import HSTURecommender

AS_LOGGED, SHUFFLED = "as logged", "shuffled"
CLICK = TASKS.index("click")


def last_k_name(k: int) -> str:
    return "history-free" if k == 0 else f"last {k}"


def shuffle_within_windows(batch: VisitBatch, rng: np.random.Generator) -> VisitBatch:
    """The batch with each user's carried events (video, action) permuted; timestamps stay in place."""
    n = len(batch.video_ids)
    user_of_event = np.repeat(np.arange(batch.batch_size), batch.history_lengths)
    order = np.lexsort((rng.random(n), user_of_event))  # a random order inside each user's run
    return VisitBatch(**{**batch.__dict__, "video_ids": batch.video_ids[order],
                         "action_weights": batch.action_weights[order]})


@dataclass(frozen=True)
class VariantScore:
    auc: dict[str, float | None]  # per task
    mean_abs_delta: float  # mean |click logit - the logged history's click logit|
    click_auc: float | None
    # click AUC minus the logged history's, with its interval over users (None for the logged history
    # itself, or where no candidate, or every one, is clicked)
    click_auc_change: PairedInterval | None = None


@dataclass(frozen=True)
class OrderAblation:
    variants: dict[str, VariantScore]  # AS_LOGGED, SHUFFLED, last_k_name(k) ...
    click_logit_std: float  # spread of the logged history's click logits
    num_requests: int
    num_candidates: int

    def relative_delta(self, variant: str) -> float:
        """Mean |Δ click logit| of a variant in units of the logged logits' std."""
        return self.variants[variant].mean_abs_delta / max(self.click_logit_std, 1e-12)

    def to_json(self) -> dict:
        return {**asdict(self), "relative_delta": {name: self.relative_delta(name) for name in self.variants}}


def order_ablation(
    model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray, batch_size: int = 8,
    last_k: tuple[int, ...] = (0, 1, 16), seed: int = 0, progress: bool = True, resamples: int = 1000,
    shuffle: bool = True,
) -> OrderAblation:
    """Score `indices` as logged, shuffled (seeded; unless not `shuffle`) and cut to each K of `last_k`; each
    variant's change of click AUC gets an interval from `resamples` resamples of the users."""
    if any(k < 0 for k in last_k):
        raise ValueError(f"last_k must be >= 0, got {last_k}")
    rng = np.random.default_rng(seed)

    def scored(name: str, **kwargs) -> ScoredCandidates:
        return score_requests(model, dataset, indices, batch_size, desc=f"order ablation: {name}", progress=progress,
                              **kwargs)

    runs = {AS_LOGGED: scored(AS_LOGGED)}
    if shuffle:
        runs[SHUFFLED] = scored(SHUFFLED, edit_batch=lambda batch: shuffle_within_windows(batch, rng))
    for k in last_k:
        runs[last_k_name(k)] = scored(last_k_name(k), max_history_events=k)
    logged = runs[AS_LOGGED].logits[:, CLICK]
    clicks = runs[AS_LOGGED].labels[:, CLICK]
    users = candidate_users(dataset, indices)
    variants = {}
    for name, run in runs.items():
        auc = per_task_auc(run.logits, run.labels, TASKS)
        delta = float(np.abs(run.logits[:, CLICK] - logged).mean()) if len(logged) else 0.0
        change = None
        if name != AS_LOGGED and auc.get("click") is not None:
            change = paired_auc_difference(run.logits[:, CLICK], logged, clicks, users, resamples=resamples, seed=seed)
        variants[name] = VariantScore(auc, delta, auc.get("click"), change)
    return OrderAblation(variants, float(logged.std()) if len(logged) else 0.0, len(indices), len(logged))


def format_ablation(result: OrderAblation) -> str:
    lines = [f"{'history':<16}{'click AUC':>11}{'Δ click AUC (95% over users)':>32}{'long_view AUC':>15}"
             f"{'mean |Δ logit|':>16}{'/ logit std':>13}"]
    for name, v in result.variants.items():
        c = v.click_auc_change
        change = "" if c is None else f"{c.estimate:+.4f} [{c.low:+.4f}, {c.high:+.4f}]"
        cells = [f"{'n/a' if a is None else f'{a:.4f}':>{w}}" for a, w in ((v.click_auc, 11), (v.auc.get("long_view"), 15))]
        lines.append(f"{name:<16}{cells[0]}{change:>32}{cells[1]}{v.mean_abs_delta:>16.4f}{result.relative_delta(name):>13.3f}")
    lines.append(f"click logit std (as logged): {result.click_logit_std:.4f} over {result.num_candidates} candidates "
                 f"of {result.num_requests} visits")
    return "\n".join(lines)


__all__ = ["AS_LOGGED", "SHUFFLED", "OrderAblation", "VariantScore", "format_ablation", "last_k_name",
           "order_ablation", "shuffle_within_windows"]
