"""How sure an AUC margin is: a paired bootstrap over users.

    interval = paired_auc_difference(hstu[:, 0], mf[:, 0], labels[:, 0], groups=user_ids)
    interval.estimate, interval.low, interval.high      # e.g. +0.013, +0.004, +0.022

A margin between two scorers of the same candidates is measured on a few dozen to a few hundred
users, and candidates of one user are not independent (one user's propensity moves all of them),
so the resampling unit is the user: each resample draws as many users as there are, with
replacement, and weighs every candidate by how often its user was drawn. Both scorers see the same
draw (paired), so what they share (which users, which visits) cancels out of the difference. The
interval is the percentile interval of the resampled differences.

The AUC of a weighted sample is the Mann-Whitney statistic with each pair (positive, negative)
counted `w_pos * w_neg` times and ties counted half, so integer weights give exactly the AUC of the
sample with those rows repeated (`tests/model/test_auc_interval.py`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

_CHUNK_VALUES = 4_000_000  # resamples are weighed in chunks of about this many float64s (32 MB)


@dataclass(frozen=True)
class PairedInterval:
    """AUC(a) - AUC(b) on the data as is, and its bootstrap interval over the groups (users)."""

    estimate: float
    low: float
    high: float
    level: float  # e.g. 0.95
    resamples: int  # resamples in which both classes occurred (the others have no AUC)
    groups: int

    def format(self) -> str:
        return f"{self.estimate:+.4f} ({self.level:.0%} interval over {self.groups} users {self.low:+.4f} to {self.high:+.4f})"

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def weighted_auc(scores: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUC of `scores` [n] against `labels` [n] under each row of `weights` [R, n] -> [R] (NaN where a
    row leaves only one class). Ties count half, as in `model.metrics.auc`."""
    runs = _TieRuns(np.asarray(scores, dtype=np.float64))
    return runs.auc(np.asarray(labels) > 0.5, np.atleast_2d(np.asarray(weights, dtype=np.float64)))


def paired_auc_difference(scores_a: np.ndarray, scores_b: np.ndarray, labels: np.ndarray, groups: np.ndarray,
                          resamples: int = 1000, level: float = 0.95, seed: int = 0) -> PairedInterval:
    """AUC(scores_a) - AUC(scores_b) with a percentile interval from `resamples` paired resamples of
    the `groups` (one id per candidate, e.g. its user)."""
    labels = np.asarray(labels) > 0.5
    n = labels.size
    if not (len(scores_a) == len(scores_b) == len(groups) == n):
        raise ValueError(f"scores {len(scores_a)} and {len(scores_b)}, groups {len(groups)}: one each for "
                         f"the {n} labelled candidates")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if labels.all() or not labels.any():
        raise ValueError("the candidates are all positive or all negative: their AUC is undefined")
    _, group_index = np.unique(np.asarray(groups), return_inverse=True)
    num_groups = int(group_index.max()) + 1
    runs_a = _TieRuns(np.asarray(scores_a, dtype=np.float64))
    runs_b = _TieRuns(np.asarray(scores_b, dtype=np.float64))
    ones = np.ones((1, n))
    estimate = float(runs_a.auc(labels, ones)[0] - runs_b.auc(labels, ones)[0])

    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_VALUES // n)
    differences = []
    for start in range(0, resamples, chunk):
        draws = rng.multinomial(num_groups, np.full(num_groups, 1.0 / num_groups), size=min(chunk, resamples - start))
        weights = draws[:, group_index].astype(np.float64)  # [R, n]: how often each candidate's user was drawn
        differences.append(runs_a.auc(labels, weights) - runs_b.auc(labels, weights))
    diffs = np.concatenate(differences)
    diffs = diffs[~np.isnan(diffs)]
    if diffs.size == 0:
        raise ValueError("no resample had both classes: too few users to resample")
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(diffs, [tail, 1.0 - tail])
    return PairedInterval(estimate, float(low), float(high), level, int(diffs.size), num_groups)


class _TieRuns:
    """One scorer's candidates in score order, cut into runs of equal scores: sorted once, weighed many times."""

    def __init__(self, scores: np.ndarray):
        self.order = np.argsort(scores, kind="mergesort")
        ordered = scores[self.order]
        self.starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])

    def auc(self, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """labels [n] bool, weights [R, n] -> [R]."""
        w = weights[:, self.order]
        positive = np.where(labels[self.order], w, 0.0)
        pos_runs = np.add.reduceat(positive, self.starts, axis=1)  # [R, runs]
        neg_runs = np.add.reduceat(w - positive, self.starts, axis=1)
        below = np.cumsum(neg_runs, axis=1) - neg_runs  # negative weight scored strictly lower than each run
        pairs = pos_runs.sum(1) * neg_runs.sum(1)
        wins = (pos_runs * (below + 0.5 * neg_runs)).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(pairs > 0, wins / pairs, np.nan)
