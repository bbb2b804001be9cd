"""Model quality against baselines: one split, the same requests, the same metric.

    split = quality_split(dataset, split_date=20220422, holdout_fraction=0.1)
    table = compare(split, {"HSTU": scored.logits})     # -> QualityTable (per-task AUC per scorer)
    table.click_margin_intervals["HSTU"].format()        # its click margin over the best baseline, with
                                                         # a paired bootstrap interval over users

The split is the trainer's (model/train.py): visits before the split date train, the last
`holdout_fraction` of them (in time) are the holdout, and every visit from the split date on
is evaluated. Every baseline (model/baselines/registry.py) is tuned the way the HSTU's epochs
are picked: each grid point is fitted on what precedes the holdout's first visit and ranked on
the holdout visits' click AUC; the best one is refitted on the whole training period (MF and
SASRec, whose fits stop on the holdout, keep that fit) and scores the evaluated candidates once.
Nothing from the evaluation period is learnt from; the sequential scorers (the HSTU, SASRec, the
Markov model) read each user's events before the visit they score, as they do when serving,
never the scored candidates' labels.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from data import jagged
from data.dataset import InferenceDataset
from data.schema import TASKS, action_labels, beijing_midnight_ms
from model.auc_interval import PairedInterval, paired_auc_difference
from model.baselines import Baseline, Interactions, Tuned, TuningData, Visits, tune
from model.baselines.registry import BASELINES, HISTORY_EVENTS
from model.metrics import per_task_auc
from model.train_params import TrainParams, split_requests
from model.video_tags import VideoTagTable


@dataclass(frozen=True)
class QualitySplit:
    train_requests: np.ndarray  # request indices the sequential models train on
    holdout_requests: np.ndarray
    eval_requests: np.ndarray  # every visit from the split date on, in time order
    fit_events: Interactions  # events before the first holdout visit
    training_period_events: Interactions  # events before the split date
    holdout_pairs: Interactions  # the holdout visits' candidates
    eval_pairs: Interactions  # the evaluated visits' candidates, in request order
    train_visits: Visits  # the same visits with each one's history, labelled
    holdout_visits: Visits
    training_period_visits: Visits  # train + holdout
    eval_visits: Visits  # unlabelled: what a sequential baseline scores

    def tuning_data(self) -> TuningData:
        return TuningData(self.fit_events, self.holdout_pairs, self.training_period_events,
                          self.train_visits, self.holdout_visits, self.training_period_visits)


def quality_split(dataset: InferenceDataset, split_date: int, holdout_fraction: float = 0.1,
                  max_eval_requests: int | None = None, history_events: int = HISTORY_EVENTS,
                  video_tags: VideoTagTable | None = None) -> QualitySplit:
    params = TrainParams(split_date=split_date, holdout_fraction=holdout_fraction)
    train, holdout = split_requests(dataset, params)
    split_ms = beijing_midnight_ms(split_date)
    evaluated = dataset.request_indices(from_time_ms=split_ms, max_requests=max_eval_requests)
    if len(evaluated) == 0:
        raise ValueError(f"no visits on or after {split_date}: nothing to evaluate")
    holdout_ms = int(dataset.requests.time_ms[holdout[0]])
    events, requests = dataset.event_arrays(), dataset.requests

    def visits(indices: np.ndarray, labelled: bool = True) -> Visits:
        return Visits.build(events, requests, indices, history_events, with_labels=labelled, video_tags=video_tags)

    return QualitySplit(
        train_requests=train, holdout_requests=holdout, eval_requests=evaluated,
        fit_events=events_before(dataset, holdout_ms), training_period_events=events_before(dataset, split_ms),
        holdout_pairs=candidate_pairs(dataset, holdout), eval_pairs=candidate_pairs(dataset, evaluated),
        train_visits=visits(train), holdout_visits=visits(holdout),
        training_period_visits=visits(np.concatenate([train, holdout])), eval_visits=visits(evaluated, labelled=False),
    )


def events_before(dataset: InferenceDataset, time_ms: int) -> Interactions:
    """Every logged event strictly before `time_ms`."""
    events = dataset.event_arrays()
    users = np.repeat(events.user_ids, np.diff(events.offsets))
    keep = events.timestamps_ms < time_ms
    return Interactions(users[keep], events.video_ids[keep], action_labels(events.action_weights[keep]))


def candidate_pairs(dataset: InferenceDataset, indices: np.ndarray) -> Interactions:
    """The candidates of requests `indices` in request order (the order the model's logits come in)."""
    events = dataset.event_arrays()
    flat = candidate_events(dataset, indices)
    return Interactions(candidate_users(dataset, indices), events.video_ids[flat], action_labels(events.action_weights[flat]))


def candidate_users(dataset: InferenceDataset, indices: np.ndarray) -> np.ndarray:
    """[M] the user of each candidate of requests `indices`, in request order."""
    return np.repeat(dataset.requests.user_id[indices], dataset.requests.num_candidates[indices])


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
    baselines: dict[str, dict[str, object]]  # baseline -> its picked parameters and holdout click AUC (Tuned.summary)
    # model -> its click AUC minus the best baseline's, with a paired bootstrap interval over users
    # (empty without baselines)
    click_margin_intervals: dict[str, PairedInterval]

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


@dataclass(frozen=True)
class BaselineRun:
    tuned: Tuned
    scores: np.ndarray  # [M, num_tasks] of the evaluated candidates


def fit_baselines(split: QualitySplit, seed: int = 0, baselines: tuple[Baseline, ...] = BASELINES,
                  progress: bool = True) -> dict[str, BaselineRun]:
    """Tune each baseline on the holdout, refit it on the training period, score the evaluated candidates."""
    runs = {}
    data, pairs = split.tuning_data(), split.eval_pairs
    for baseline in baselines:
        tuned = tune(baseline, data, seed, progress)
        if baseline.sequential:
            scores = tuned.scorer.score(split.eval_visits)
        else:
            scores = tuned.scorer.score(pairs.user_ids, pairs.video_ids)
        runs[baseline.name] = BaselineRun(tuned, scores)
    return runs


def compare(split: QualitySplit, model_scores: dict[str, np.ndarray], seed: int = 0,
            baselines: tuple[Baseline, ...] = BASELINES, progress: bool = True,
            resamples: int = 1000) -> QualityTable:
    """Per-task AUC of the models' and the baselines' scores of the evaluated candidates, and each
    model's click margin over the best baseline with its interval over `resamples` resamples of the users
    (model/auc_interval.py; the best baseline is the one with the highest click AUC as measured)."""
    labels = split.eval_pairs.labels
    for name, scores in model_scores.items():
        if scores.shape != labels.shape:
            raise ValueError(f"{name}: scores of shape {scores.shape} for {labels.shape[0]} candidates x "
                             f"{labels.shape[1]} tasks (score every candidate of split.eval_requests, in order)")
    runs = fit_baselines(split, seed, baselines, progress)
    scorers = {**model_scores, **{name: run.scores for name, run in runs.items()}}
    auc = {name: per_task_auc(scores, labels, TASKS) for name, scores in scorers.items()}
    picks = {name: run.tuned.summary() for name, run in runs.items()}
    table = QualityTable(auc, tuple(model_scores), len(labels), len(split.eval_requests), picks, {})
    if not any(auc[name]["click"] is not None for name in runs):
        return table
    click = TASKS.index("click")
    best = runs[table.best_baseline("click")[0]].scores[:, click]
    intervals = {name: paired_auc_difference(scores[:, click], best, labels[:, click], split.eval_pairs.user_ids,
                                             resamples=resamples, seed=seed)
                 for name, scores in model_scores.items()}
    return replace(table, click_margin_intervals=intervals)
