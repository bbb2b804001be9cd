"""Per-task ranking metrics."""
from __future__ import annotations

import numpy as np


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """ROC AUC via the Mann-Whitney rank statistic (ties get their average rank).

    None when only one class is present (AUC is undefined there, not 0.5).
    """
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels) > 0.5
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average rank (1-based) over each run of equal scores.
    run_starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    run_ends = np.r_[run_starts[1:], scores.size]
    average = (run_starts + run_ends + 1) / 2.0
    ranks[order] = np.repeat(average, run_ends - run_starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def per_task_auc(logits: np.ndarray, labels: np.ndarray, task_names: tuple[str, ...]) -> dict[str, float | None]:
    """logits, labels: [num_candidates, num_tasks]."""
    return {name: auc(logits[:, t], labels[:, t]) for t, name in enumerate(task_names)}


SELECT_ON = ("click_auc", "loss")  # holdout scores that can pick what a fit keeps (an epoch, a check)


def selection_score(select_on: str, holdout_loss: float, click_auc: float | None, remedy: str) -> float:
    """Lower is better: the holdout loss, or 1 - its click AUC. The AUC is undefined when the holdout's
    candidates are all clicked or none is; `remedy` says what to do then."""
    if select_on == "loss":
        return holdout_loss
    if click_auc is None:
        raise ValueError(f"the holdout's click AUC is undefined (its candidates are all clicked or none is): {remedy}")
    return 1.0 - click_auc
