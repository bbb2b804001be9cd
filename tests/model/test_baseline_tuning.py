"""Hyper-parameter picking (model/baselines/tuning.py): on the holdout's click AUC, then one refit."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import click_interactions, transition_visits
from model.baselines import Baseline, Interactions, LastItemsMarkov, PairScorer, TuningData, grid, tune


class _Spy(PairScorer):
    """Score = sign x video id; remembers what it was fitted on."""

    name = "spy"

    def __init__(self, sign: float):
        self.sign = sign

    def fit(self, train: Interactions, holdout: Interactions | None = None) -> _Spy:
        self.fitted_on, self.holdout = train, holdout
        return self

    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        return np.repeat((self.sign * video_ids.astype(np.float64))[:, None], 8, axis=1)


class _StoppingSpy(_Spy):
    """A spy whose fit stops on the holdout: the tuner keeps that fit."""

    name = "stopping spy"
    stops_on_holdout = True

    def picked(self) -> dict[str, object]:
        return {"steps": 7}


def _tuning_data() -> TuningData:
    """Holdout clicks rise with the video id: the point with sign +1 wins there."""
    rng = np.random.default_rng(0)
    videos = np.arange(100)
    holdout = click_interactions(np.zeros(100), videos, rng.random(100) < videos / 100)
    fit, refit = click_interactions([0], [1], [1]), click_interactions([0, 1], [1, 2], [1, 0])
    visits = transition_visits(rng, 20)
    return TuningData(fit, holdout, refit, visits, visits, visits)


def test_tuning_picks_on_the_holdout_then_refits_on_the_training_period():
    data = _tuning_data()
    tuned = tune(Baseline(_Spy, grid(sign=(-1.0, 1.0))), data, progress=False)
    assert tuned.params == {"sign": 1.0} and tuned.holdout_click_auc > 0.7
    assert [trial.params["sign"] for trial in tuned.trials] == [-1.0, 1.0]
    assert tuned.trials[0].holdout_click_auc == pytest.approx(1 - tuned.holdout_click_auc)
    assert tuned.scorer.fitted_on is data.refit_events and tuned.scorer.holdout is None
    assert tuned.summary() == {"params": {"sign": 1.0}, "holdout_click_auc": tuned.holdout_click_auc, "grid_points": 2}


def test_a_fit_that_stops_on_the_holdout_is_kept_not_refitted():
    data = _tuning_data()
    tuned = tune(Baseline(_StoppingSpy, grid(sign=(1.0, -1.0))), data, progress=False)
    assert tuned.params == {"sign": 1.0, "steps": 7}
    assert tuned.scorer.fitted_on is data.fit_events and tuned.scorer.holdout is data.holdout_pairs
    assert tuned.scorer.sign == 1.0


def test_sequential_baselines_are_tuned_on_visits():
    data = _tuning_data()
    tuned = tune(Baseline(LastItemsMarkov, grid(last_events=(1, 5))), data, progress=False)
    assert len(tuned.trials) == 2 and tuned.params in [{"last_events": 1}, {"last_events": 5}]
    assert tuned.scorer.score(data.holdout_visits.unlabelled()).shape == data.holdout_visits.labels.shape


def test_tuning_refuses_what_cannot_be_tuned():
    with pytest.raises(ValueError, match="grid axis 'sign' has no values"):
        grid(sign=())
    with pytest.raises(ValueError, match="_Spy: an empty grid"):
        Baseline(_Spy, ())
    data = _tuning_data()
    all_clicked = TuningData(data.fit_events, click_interactions([0, 0], [1, 2], [1, 1]), data.refit_events,
                             data.fit_visits, data.holdout_visits, data.refit_visits)
    with pytest.raises(ValueError, match="spy cannot be tuned on a holdout whose candidates are all clicked"):
        tune(Baseline(_Spy, grid(sign=(1.0,))), all_clicked, progress=False)
