"""Hyper-parameters picked the way the HSTU's epochs are: on the holdout's click AUC.

For every point of a baseline's grid: fit on the events (or visits) before the holdout, score the
holdout's candidates, and rank the point by `model.metrics.selection_score` on their click AUC.
The best point (the first, on a tie) is refitted once on the whole training period, except for a
scorer whose fit stops on the holdout (MF's check, SASRec's epoch): that fit is kept, as the HSTU
trainer keeps its best holdout epoch (a refit with the kept epoch count on more visits is another
run, which may land far from the one picked). `TuningData` holds no evaluation data, so nothing
picked here can depend on it; the caller scores the evaluation visits with the returned scorer, once.
"""
from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from model.baselines.base import Interactions, PairScorer, Visits, VisitScorer
from model.metrics import auc, selection_score

Scorer = PairScorer | VisitScorer


def grid(**axes: tuple) -> tuple[dict[str, object], ...]:
    """Every combination of the axes' values: grid(a=(1, 2), b=("x",)) -> ({a: 1, b: x}, {a: 2, b: x})."""
    for name, values in axes.items():
        if not values:
            raise ValueError(f"grid axis {name!r} has no values")
    return tuple(dict(zip(axes, values)) for values in itertools.product(*axes.values()))


@dataclass(frozen=True)
class Baseline:
    """A scorer class, the grid its constructor is tuned over, and whether it takes a `seed`; `tag_grid`:
    more points, tried only on visits that carry the data's video tags (`Visits.video_tags`)."""

    scorer: type[PairScorer] | type[VisitScorer]
    grid: tuple[dict[str, object], ...]
    seeded: bool = False
    tag_grid: tuple[dict[str, object], ...] = ()

    def __post_init__(self) -> None:
        if not self.grid:
            raise ValueError(f"{self.scorer.__name__}: an empty grid (use ({{}},) for a scorer without parameters)")

    @property
    def name(self) -> str:
        return self.scorer.name

    @property
    def sequential(self) -> bool:
        return issubclass(self.scorer, VisitScorer)

    def points(self, data: TuningData) -> tuple[dict[str, object], ...]:
        """The grid points to try on `data`."""
        with_tags = self.sequential and data.fit_visits.video_tags is not None
        return self.grid + self.tag_grid if with_tags else self.grid

    def build(self, params: dict[str, object], seed: int) -> Scorer:
        return self.scorer(**params, seed=seed) if self.seeded else self.scorer(**params)


@dataclass(frozen=True)
class TuningData:
    """What tuning may read. Pair scorers fit on `fit_events` and are ranked on `holdout_pairs`; visit
    scorers on `fit_visits` and `holdout_visits`. The picked one is refitted on the `refit_*` data."""

    fit_events: Interactions
    holdout_pairs: Interactions
    refit_events: Interactions
    fit_visits: Visits
    holdout_visits: Visits
    refit_visits: Visits


@dataclass(frozen=True)
class Trial:
    params: dict[str, object]  # the grid point, with what its fit picked from the holdout
    holdout_click_auc: float | None


@dataclass(frozen=True)
class Tuned:
    name: str
    params: dict[str, object]  # what the final fit used
    holdout_click_auc: float | None  # the picked trial's
    trials: tuple[Trial, ...]
    scorer: Scorer  # refitted on the refit data, or the kept fit of one that stops on the holdout

    def summary(self) -> dict[str, object]:
        return {"params": self.params, "holdout_click_auc": self.holdout_click_auc, "grid_points": len(self.trials)}


def tune(baseline: Baseline, data: TuningData, seed: int = 0, progress: bool = True) -> Tuned:
    fit_on, holdout, refit_on, score_holdout = _stages(baseline, data)
    remedy = f"{baseline.name} cannot be tuned on a holdout whose candidates are all clicked or none is"
    trials, best, best_rank, kept = [], None, float("inf"), None
    for params in tqdm(baseline.points(data), desc=f"tune {baseline.name}", leave=False, file=sys.stderr, disable=not progress):
        scorer = baseline.build(params, seed).fit(fit_on, holdout)
        trial = Trial({**params, **scorer.picked()}, auc(score_holdout(scorer)[:, 0], holdout.labels[:, 0]))
        trials.append(trial)
        rank = selection_score("click_auc", float("nan"), trial.holdout_click_auc, remedy)
        if rank < best_rank:
            best, best_rank, kept = trial, rank, scorer
    if baseline.scorer.stops_on_holdout:
        final = kept
    else:
        final = baseline.build(best.params, seed).fit(refit_on)
    return Tuned(baseline.name, best.params, best.holdout_click_auc, tuple(trials), final)


def _stages(baseline: Baseline, data: TuningData) -> tuple[object, Interactions | Visits, object, Callable]:
    """-> (fit data, labelled holdout, refit data, scorer -> [M, T] holdout scores) for the baseline's kind."""
    if baseline.sequential:
        unlabelled = data.holdout_visits.unlabelled()
        return data.fit_visits, data.holdout_visits, data.refit_visits, lambda scorer: scorer.score(unlabelled)
    pairs = data.holdout_pairs
    return (data.fit_events, pairs, data.refit_events,
            lambda scorer: np.asarray(scorer.score(pairs.user_ids, pairs.video_ids)))
