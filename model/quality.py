"""Model quality against baselines: one split, the same requests, the same metric.

    split = quality_split(dataset, split_date=20220422, holdout_fraction=0.1)
    table = compare(split, {"HSTU": scored.logits})     # -> QualityTable (per-task AUC per scorer)

The split is the trainer's (model/train.py): visits before the split date train, the last
`holdout_fraction` of them (in time) are the holdout, and every visit from the split date on
is evaluated. Baselines learn from logged events: those before the holdout's first visit for
fitting, the holdout visits' candidates for matrix factorisation's early stopping, and every
event before the split date for the final fit of the count-based scorers (popularity, kNN).
Nothing from the evaluation period is seen, except by the sequential model, which reads each
user's history up to the visit it scores, as it does when serving.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data import jagged
from data.dataset import InferenceDataset
from data.schema import TASKS, action_labels
from model.baselines import Interactions, ItemPopularity, MatrixFactorization, UserKNN
from model.metrics import per_task_auc
from model.train import TrainParams, date_to_ms, split_requests


@dataclass(frozen=True)
class QualitySplit:
    train_requests: np.ndarray  # request indices the sequential model trains on
    holdout_requests: np.ndarray
    eval_requests: np.ndarray  # every visit from the split date on, in time order
    fit_events: Interactions  # events before the first holdout visit
    training_period_events: Interactions  # events before the split date
    holdout_pairs: Interactions  # the holdout visits' candidates
    eval_pairs: Interactions  # the evaluated visits' candidates, in request order


def quality_split(dataset: InferenceDataset, split_date: int, holdout_fraction: float = 0.1,
                  max_eval_requests: int | None = None) -> QualitySplit:
    params = TrainParams(split_date=split_date, holdout_fraction=holdout_fraction)
    train, holdout = split_requests(dataset, params)
    split_ms = date_to_ms(split_date)
    evaluated = dataset.request_indices(from_time_ms=split_ms, max_requests=max_eval_requests)
    if len(evaluated) == 0:
        raise ValueError(f"no visits on or after {split_date}: nothing to evaluate")
    holdout_ms = int(dataset.requests.time_ms[holdout[0]])
    return QualitySplit(
        train_requests=train, holdout_requests=holdout, eval_requests=evaluated,
        fit_events=events_before(dataset, holdout_ms), training_period_events=events_before(dataset, split_ms),
        holdout_pairs=candidate_pairs(dataset, holdout), eval_pairs=candidate_pairs(dataset, evaluated),
    )


def events_before(dataset: InferenceDataset, time_ms: int) -> Interactions:
    """Every logged event strictly before `time_ms`."""
    events = dataset.event_arrays()
    users = np.repeat(events.user_ids, np.diff(events.offsets))
    keep = events.timestamps_ms < time_ms
    return Interactions(users[keep], events.video_ids[keep], action_labels(events.action_weights[keep]))


def candidate_pairs(dataset: InferenceDataset, indices: np.ndarray) -> Interactions:
    """The candidates of requests `indices` in request order (the order the model's logits come in)."""
    events, req = dataset.event_arrays(), dataset.requests
    flat = candidate_events(dataset, indices)
    users = np.repeat(req.user_id[indices], req.num_candidates[indices])
    return Interactions(users, events.video_ids[flat], action_labels(events.action_weights[flat]))


def candidate_events(dataset: InferenceDataset, indices: np.ndarray) -> np.ndarray:
    """[M] where the candidates of requests `indices` are in `dataset.event_arrays()`, in request order."""
    events, req = dataset.event_arrays(), dataset.requests
    rows = np.searchsorted(events.user_ids, req.user_id[indices])
    return jagged.range_indices(events.offsets[rows] + req.end[indices], req.num_candidates[indices])


@dataclass(frozen=True)
class QualityTable:
    auc: dict[str, dict[str, float | None]]  # scorer -> task -> AUC on the evaluated candidates
    model_names: tuple[str, ...]  # the scorers that are not baselines
    num_candidates: int
    num_requests: int

    def best_baseline(self, task: str = "click") -> tuple[str, float]:
        scores = {name: a[task] for name, a in self.auc.items() if name not in self.model_names and a[task] is not None}
        name = max(scores, key=scores.get)
        return name, scores[name]

    def margin(self, model: str, task: str = "click") -> float:
        """The model's AUC minus the best baseline's, on `task`."""
        return self.auc[model][task] - self.best_baseline(task)[1]

    def format(self, tasks: tuple[str, ...] = TASKS) -> str:
        width = max(len(n) for n in self.auc) + 2
        lines = [f"{'scorer':<{width}}" + "".join(f"{t:>14}" for t in tasks)]
        for name, aucs in self.auc.items():
            cells = "".join(f"{'n/a' if aucs[t] is None else f'{aucs[t]:.4f}':>14}" for t in tasks)
            lines.append(f"{name:<{width}}" + cells)
        return "\n".join(lines)


def fit_baselines(split: QualitySplit, seed: int = 0) -> dict[str, np.ndarray]:
    """-> scorer name -> [M, num_tasks] scores of the evaluated candidates."""
    pairs = split.eval_pairs
    mf = MatrixFactorization(seed=seed).fit(split.fit_events, holdout=split.holdout_pairs)
    return {
        ItemPopularity.name: ItemPopularity().fit(split.training_period_events).score(pairs.user_ids, pairs.video_ids),
        UserKNN.name: UserKNN().fit(split.training_period_events).score(pairs.user_ids, pairs.video_ids),
        MatrixFactorization.name: mf.score(pairs.user_ids, pairs.video_ids),
    }


def compare(split: QualitySplit, model_scores: dict[str, np.ndarray], seed: int = 0) -> QualityTable:
    """Per-task AUC of the models' and the baselines' scores of the evaluated candidates."""
    labels = split.eval_pairs.labels
    for name, scores in model_scores.items():
        if scores.shape != labels.shape:
            raise ValueError(f"{name}: scores of shape {scores.shape} for {labels.shape[0]} candidates x "
                             f"{labels.shape[1]} tasks (score every candidate of split.eval_requests, in order)")
    scorers = {**model_scores, **fit_baselines(split, seed)}
    auc = {name: per_task_auc(scores, labels, TASKS) for name, scores in scorers.items()}
    return QualityTable(auc, tuple(model_scores), len(labels), len(split.eval_requests))
