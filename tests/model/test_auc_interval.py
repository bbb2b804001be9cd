"""The paired bootstrap of an AUC margin (model/auc_interval.py)."""
from __future__ import annotations

import numpy as np
import pytest

from model.auc_interval import paired_auc_difference, weighted_auc
from model.metrics import auc


def _candidates(rng: np.random.Generator, users: int, per_user: int, skill: float):
    """Clicks driven by a per-user propensity and an item signal; a scorer that sees the item signal
    with strength `skill`, and one that sees only noise."""
    user = np.repeat(np.arange(users), per_user)
    propensity = rng.normal(0, 1, users)[user]
    item = rng.normal(0, 1, user.size)
    labels = (rng.random(user.size) < 1 / (1 + np.exp(-(propensity + item)))).astype(np.float32)
    good = propensity + skill * item + rng.normal(0, 1, user.size)
    plain = propensity + rng.normal(0, 1, user.size)
    return user, labels, good, plain


def test_unit_weights_give_the_plain_auc_ties_included():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 500).astype(np.float64)  # many ties
    labels = rng.random(500) < 0.4
    assert weighted_auc(scores, labels, np.ones((1, 500)))[0] == pytest.approx(auc(scores, labels), abs=1e-12)


def test_integer_weights_equal_the_auc_of_repeated_rows():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 30, 300).astype(np.float64)
    labels = rng.random(300) < 0.3
    weights = rng.integers(0, 4, (3, 300))
    got = weighted_auc(scores, labels, weights)
    for row, value in zip(weights, got):
        repeated = np.repeat(np.arange(300), row)
        assert value == pytest.approx(auc(scores[repeated], labels[repeated]), abs=1e-12)


def test_a_weighting_with_one_class_has_no_auc():
    labels = np.array([1, 1, 0, 0], dtype=bool)
    weights = np.array([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=np.float64)
    got = weighted_auc(np.array([0.1, 0.4, 0.2, 0.3]), labels, weights)
    assert np.isnan(got[0]) and got[1] == pytest.approx(0.0)


def test_a_scorer_against_itself_has_a_zero_interval():
    rng = np.random.default_rng(2)
    user, labels, good, _ = _candidates(rng, 40, 30, 1.0)
    interval = paired_auc_difference(good, good, labels, user, resamples=200)
    assert (interval.estimate, interval.low, interval.high) == (0.0, 0.0, 0.0)
    assert interval.groups == 40 and interval.resamples == 200


def test_the_interval_holds_the_margin_and_excludes_zero_for_a_clearly_better_scorer():
    rng = np.random.default_rng(3)
    user, labels, good, plain = _candidates(rng, 200, 40, 1.0)
    interval = paired_auc_difference(good, plain, labels, user, resamples=300)
    assert interval.estimate == pytest.approx(auc(good, labels) - auc(plain, labels), abs=1e-12)
    assert 0 < interval.low < interval.estimate < interval.high
    flipped = paired_auc_difference(plain, good, labels, user, resamples=300)
    assert flipped.high < 0


def test_fewer_users_give_a_wider_interval_and_a_seed_repeats_it():
    rng = np.random.default_rng(4)
    user, labels, good, plain = _candidates(rng, 400, 20, 0.5)
    few = np.flatnonzero(user < 25)
    wide = paired_auc_difference(good[few], plain[few], labels[few], user[few], resamples=300)
    narrow = paired_auc_difference(good, plain, labels, user, resamples=300)
    assert wide.high - wide.low > 2 * (narrow.high - narrow.low)
    again = paired_auc_difference(good, plain, labels, user, resamples=300)
    assert again == narrow
    other = paired_auc_difference(good, plain, labels, user, resamples=300, seed=1)
    assert other.low != narrow.low


def test_bad_input_names_the_problem():
    labels = np.array([1, 0, 1, 0], dtype=np.float32)
    scores = np.array([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match="groups 3"):
        paired_auc_difference(scores, scores, labels, np.arange(3))
    with pytest.raises(ValueError, match="all positive or all negative"):
        paired_auc_difference(scores, scores, np.ones(4), np.arange(4))
    with pytest.raises(ValueError, match="level"):
        paired_auc_difference(scores, scores, labels, np.arange(4), level=1.0)
