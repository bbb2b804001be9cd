"""Pair-scoring baselines (model/baselines/), the quality comparison (model/quality.py) and its script.
The sequential baselines and the tuning have their own modules."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from data.dataset import InferenceDataset
from data.schema import beijing_midnight_ms
from helpers import block_taste_events, build_processed, click_interactions, subprocess_env
from model.baselines import (
    Baseline,
    ImplicitALS,
    ImplicitBPR,
    Interactions,
    ItemKNN,
    ItemPopularity,
    MatrixFactorization,
    UserKNN,
)
from model.baselines.registry import BASELINES
from model.checkpoint import load_checkpoint
from model.metrics import auc
from model.quality import compare, fit_baselines, quality_split


def test_popularity_counts_the_tasks_positives():
    train = click_interactions([0, 1, 2, 0, 1], [10, 10, 11, 12, 12], [1, 1, 1, 0, 1])
    scores = ItemPopularity().fit(train).score(np.zeros(4, np.int64), np.array([10, 11, 12, 99]))
    assert scores[:, 0].tolist() == [2, 1, 1, 0]  # an unseen video scores 0
    with pytest.raises(ValueError, match="one row per event"):
        Interactions(np.zeros(2, np.int64), np.zeros(3, np.int64), np.zeros((2, 8), np.float32))


def test_user_knn_scores_what_similar_users_clicked():
    # Users 0 and 1 click the same videos; user 2 clicks others. User 0 has not seen video 5.
    train = click_interactions([0, 0, 1, 1, 1, 2, 2, 2], [1, 2, 1, 2, 5, 3, 4, 6], [1, 1, 1, 1, 1, 1, 1, 1])
    knn = UserKNN(neighbours=1).fit(train)
    scores = knn.score(np.array([0, 0, 0]), np.array([5, 6, 7]))[:, 0]
    assert scores[0] > 0 and scores[1] == 0 and scores[2] == 0  # 5: its neighbour's click; 6: not a neighbour's
    with pytest.raises(ValueError, match="neighbours"):
        UserKNN(neighbours=0)


def test_matrix_factorization_learns_a_planted_preference():
    """Two user groups, two video groups: a group clicks its own group's videos 80% of the time."""
    rng = np.random.default_rng(0)
    n, users, videos = 6000, 40, 60
    u, v = rng.integers(0, users, n), rng.integers(0, videos, n)
    clicks = rng.random(n) < np.where((u % 2) == (v % 2), 0.8, 0.2)
    train, held = click_interactions(u[:5000], v[:5000], clicks[:5000]), click_interactions(u[5000:], v[5000:], clicks[5000:])
    mf = MatrixFactorization(dim=16, seed=0).fit(train, holdout=held)
    assert auc(mf.score(held.user_ids, held.video_ids)[:, 0], held.labels[:, 0]) > 0.75
    scores = mf.score(np.array([0, 0]), np.array([999, 999]))  # an unseen video: finite, defined
    assert np.isfinite(scores).all()


@pytest.mark.parametrize("select_on", ["click_auc", "loss"])
def test_matrix_factorization_keeps_its_best_holdout_check(select_on):
    """The kept parameters are those of the check with the best holdout score on the chosen criterion."""
    rng = np.random.default_rng(1)
    n, users, videos = 3000, 30, 400  # many videos seen a few times: the factors overfit as steps go on
    u, v = rng.integers(0, users, n), rng.integers(0, videos, n)
    clicks = rng.random(n) < np.where((u % 2) == (v % 2), 0.7, 0.3)
    train, held = click_interactions(u[:2500], v[:2500], clicks[:2500]), click_interactions(u[2500:], v[2500:], clicks[2500:])
    mf = MatrixFactorization(dim=8, steps=120, eval_every=5, patience=100, seed=0, select_on=select_on).fit(train, held)
    assert len(mf.holdout_scores) == 24
    best_step, best_score = min(mf.holdout_scores, key=lambda check: check[1])
    assert best_step < 120, "the planted overfitting did not happen: the test checks nothing"
    assert mf._holdout_score(held) == pytest.approx(best_score, abs=1e-12)
    with pytest.raises(ValueError, match="select_on must be loss or click_auc"):
        MatrixFactorization(select_on="auc")
    all_clicked = click_interactions(u[:10], v[:10], np.ones(10))
    with pytest.raises(ValueError, match="click AUC is undefined"):
        MatrixFactorization(steps=10, eval_every=5).fit(train, all_clicked)


def _audience_events(rng: np.random.Generator, n: int) -> Interactions:
    """Item-taste data in small: two user groups; 70% of a user's exposures are its own group's videos
    (the logged policy knows the tastes), which it clicks 70% of the time, the others 30%; 1,500 videos."""
    u = rng.integers(0, 60, n)
    v = np.where(rng.random(n) < 0.7, 2 * rng.integers(0, 750, n) + u % 2, rng.integers(0, 1500, n))
    return click_interactions(u, v, rng.random(n) < np.where(u % 2 == v % 2, 0.7, 0.3))


def test_matrix_factorization_places_rarely_seen_videos_by_their_audience():
    """A video is seen ~3 times in training: its labels alone barely place it, who was shown it does."""
    rng = np.random.default_rng(0)
    train, held, fresh = _audience_events(rng, 4000), _audience_events(rng, 1000), _audience_events(rng, 3000)

    def fresh_click_auc(exposure_weight: float) -> float:
        mf = MatrixFactorization(dim=8, steps=300, patience=10, exposure_weight=exposure_weight, seed=0)
        mf.fit(train, held)
        return auc(mf.score(fresh.user_ids, fresh.video_ids)[:, 0], fresh.labels[:, 0])

    labels_only, with_exposures = fresh_click_auc(0.0), fresh_click_auc(3.0)
    assert labels_only < 0.53 and with_exposures > labels_only + 0.03, (labels_only, with_exposures)
    with pytest.raises(ValueError, match="exposure_weight must be >= 0, got -1"):
        MatrixFactorization(exposure_weight=-1)


IMPLICIT_MODELS = {
    "als": lambda: ImplicitALS(factors=8, regularization=1.0),
    "bpr": lambda: ImplicitBPR(factors=8, iterations=200),
    "item-knn": lambda: ItemKNN(neighbours=30),
}


@pytest.mark.parametrize("name", list(IMPLICIT_MODELS))
def test_implicit_baselines_recover_block_tastes(name):
    """Users click their own parity's videos: each model ranks fresh pairs by it, where popularity cannot
    (the group indicator itself scores 0.8 under the 80/20 label noise; BPR reaches 0.69)."""
    rng = np.random.default_rng(0)
    train, fresh = block_taste_events(rng, 4000), block_taste_events(rng, 2000)
    scores = IMPLICIT_MODELS[name]().fit(train).score(fresh.user_ids, fresh.video_ids)
    assert scores.shape == (2000, 8) and np.all(scores == scores[:, :1])  # one score for every task
    assert auc(scores[:, 0], fresh.labels[:, 0]) > 0.65
    popularity = ItemPopularity().fit(train).score(fresh.user_ids, fresh.video_ids)
    assert auc(popularity[:, 0], fresh.labels[:, 0]) < 0.6


@pytest.mark.parametrize("name", list(IMPLICIT_MODELS))
def test_implicit_baselines_score_an_unseen_video_as_the_users_average_one(name):
    rng = np.random.default_rng(1)
    model = IMPLICIT_MODELS[name]().fit(block_taste_events(rng, 4000))
    even, odd = np.arange(0, 60, 2), np.arange(1, 60, 2)
    liked = model.score(np.zeros(30, np.int64), even)[:, 0].mean()  # user 0 likes even videos
    disliked = model.score(np.zeros(30, np.int64), odd)[:, 0].mean()
    unseen_video, unseen_user = model.score(np.array([0, 999]), np.array([999, 0]))[:, 0]
    assert disliked < unseen_video < liked
    assert np.isfinite(unseen_user)


def test_implicit_baselines_refuse_bad_parameters():
    with pytest.raises(ValueError, match="signal must be one of actions, exposures, got 'clicks'"):
        ImplicitALS(signal="clicks")
    with pytest.raises(ValueError, match="factors must be >= 1, got 0"):
        ImplicitBPR(factors=0)
    with pytest.raises(ValueError, match="weighting must be one of cosine, bm25, got 'jaccard'"):
        ItemKNN(weighting="jaccard")
    with pytest.raises(ValueError, match="neighbours must be >= 1, got 0"):
        ItemKNN(neighbours=0)


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    return build_processed(tmp_path_factory.mktemp("quality"), scale=0.002, seed=3)


def test_quality_split_keeps_the_evaluation_period_unseen(processed):
    dataset = InferenceDataset(processed)
    split = quality_split(dataset, 20220422)
    split_ms = beijing_midnight_ms(20220422)
    assert np.all(dataset.requests.time_ms[split.eval_requests] >= split_ms)
    assert np.all(dataset.requests.time_ms[split.train_requests] < dataset.requests.time_ms[split.holdout_requests[0]])
    expected = int(dataset.requests.num_candidates[split.eval_requests].sum())
    assert len(split.eval_pairs.user_ids) == expected
    assert len(split.fit_events.user_ids) < len(split.training_period_events.user_ids)
    # The sequential baselines' visits: the evaluated ones unlabelled, the others the same candidates.
    assert split.eval_visits.labels is None
    np.testing.assert_array_equal(split.eval_visits.candidate_videos, split.eval_pairs.video_ids)
    np.testing.assert_array_equal(split.holdout_visits.labels, split.holdout_pairs.labels)
    assert len(split.training_period_visits) == len(split.train_visits) + len(split.holdout_visits)
    with pytest.raises(ValueError, match=r"scores of shape \(3, 8\)"):
        compare(split, {"model": np.zeros((3, 8))})


def test_compare_gives_each_model_its_click_margin_with_an_interval_over_users(processed):
    split = quality_split(InferenceDataset(processed), 20220422)
    popularity = next(b for b in BASELINES if b.name == ItemPopularity.name)
    labels = split.eval_pairs.labels
    rng = np.random.default_rng(0)
    models = {"labels": labels + rng.normal(0, 1.0, labels.shape), "noise": rng.normal(0, 1, labels.shape)}
    table = compare(split, models, baselines=(popularity,), progress=False, resamples=200)
    for name in models:
        interval = table.click_margin_intervals[name]
        assert interval.estimate == pytest.approx(table.margin(name), abs=1e-12)
        assert interval.groups == len(np.unique(split.eval_pairs.user_ids)) and interval.resamples == 200
    assert table.click_margin_intervals["labels"].low > 0  # a scorer that reads the labels is surely better
    assert table.click_margin_intervals["noise"].low < table.click_margin_intervals["noise"].estimate
    assert compare(split, {}, baselines=(popularity,), progress=False).click_margin_intervals == {}


def test_baselines_read_no_evaluation_label(processed):
    """Scrambling every evaluated candidate's labels in the split leaves every baseline's scores as they were."""
    split = quality_split(InferenceDataset(processed), 20220422)
    pairs = split.eval_pairs
    scrambled = replace(split, eval_pairs=Interactions(pairs.user_ids, pairs.video_ids, 1.0 - pairs.labels))
    first_points = tuple(Baseline(b.scorer, b.grid[:1], b.seeded) for b in BASELINES)  # every kind, fast
    before = fit_baselines(split, baselines=first_points, progress=False)
    after = fit_baselines(scrambled, baselines=first_points, progress=False)
    assert set(before) == {b.name for b in BASELINES}
    for name, run in before.items():
        np.testing.assert_array_equal(run.scores, after[name].scores, err_msg=name)
        assert run.tuned.params == after[name].tuned.params


def test_quality_benchmark_script(processed, tmp_path):
    """Trains a tiny model per seed, scores the evaluation period through the KV cache, prints and writes the
    table of each seed and the smallest margin."""
    out = tmp_path / "quality.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmark.quality.against_baselines", "--data_dir", str(processed),
         "--checkpoint", str(tmp_path / "ckpt"), "--preset", "tiny", "--epochs", "1", "--max_eval_requests", "60",
         "--seeds", "0", "3", "--quick", "--output", str(out)],
        # Two seeds, each fitting every baseline at its quick point (the full grids: the tuning tests).
        # The limit only stops a hang.
        capture_output=True, text=True, env=subprocess_env(), timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [run["seed"] for run in report["seeds"]] == [0, 3]
    for run in report["seeds"]:
        assert set(run["auc"]) == {"HSTU"} | {b.name for b in BASELINES} == {"HSTU"} | set(run["baselines"])
        assert all(pick["grid_points"] >= 1 and 0.0 < pick["holdout_click_auc"] < 1.0 for pick in run["baselines"].values())
        assert all(0.0 < a["click"] < 1.0 for a in run["auc"].values())
        assert run["training"]["candidates_per_second"] > 0
        assert run["click_best_baseline"]["name"] != "HSTU"
        assert run["click_margin"] == pytest.approx(run["auc"]["HSTU"]["click"] - run["click_best_baseline"]["auc"])
        interval = run["click_margin_interval"]
        assert interval["estimate"] == pytest.approx(run["click_margin"], abs=1e-12)
        assert interval["low"] <= interval["estimate"] <= interval["high"] and interval["resamples"] == 1000
    margins = [run["click_margin"] for run in report["seeds"]]
    assert report["click_margin_min"] == min(margins)
    assert report["passes"] == sum(m >= report["click_margin_target"] for m in margins)
    intervals = [run["click_margin_interval"] for run in report["seeds"]]
    assert report["intervals_above_zero"] == sum(i["low"] > 0 for i in intervals)
    assert "users" in result.stdout and "intervals: above zero on" in result.stdout
    assert "click: HSTU" in result.stdout and "candidates/s" in result.stdout and "over 2 seeds" in result.stdout
    for seed in (0, 3):
        assert load_checkpoint(tmp_path / "ckpt" / f"seed_{seed}").metadata["params"]["seed"] == seed


def test_quality_benchmark_refuses_a_repeated_seed(processed, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmark.quality.against_baselines", "--data_dir", str(processed),
         "--checkpoint", str(tmp_path / "ckpt"), "--seeds", "1", "1", "--output", str(tmp_path / "q.json")],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )
    assert result.returncode == 2 and "--seeds repeats a seed: [1, 1]" in result.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "q.json").exists()


def test_quality_benchmark_refuses_an_unknown_baseline(processed, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmark.quality.against_baselines", "--data_dir", str(processed),
         "--baselines", "item popularity", "random forest", "--output", str(tmp_path / "q.json")],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )
    assert result.returncode == 2 and "--baselines: unknown baseline 'random forest'" in result.stderr
    assert not (tmp_path / "q.json").exists()
