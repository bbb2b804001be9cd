"""benchmark/quality/bounds.py: the generator's own quantities as scores, and the quality posterior."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from benchmark.quality.bounds import bayes_click_probability, candidate_sightings, quality_posterior_mean, sighting_buckets
from data.synthetic_world import World, draw_actions, signal_config
from helpers import build_processed, subprocess_env
from model.baselines import Interactions


def test_quality_posterior_mean_recovers_quality_and_shrinks_rare_videos():
    config = signal_config("item")
    rng = np.random.default_rng(0)
    world = World.draw(rng, 5e-5, config)  # 7 users, 219 videos
    n = 40_000
    users = rng.integers(0, world.num_users, n)
    videos = np.minimum((world.num_videos * rng.random(n) ** 2).astype(np.int64), world.num_videos - 1)  # heavy head
    rate = config.rates[0]
    clicks = draw_actions(rng, world.affinity(users, videos), config.rates, config)["is_click"]
    labels = np.zeros((n, 8), np.float32)
    labels[:, 0] = clicks
    quality_std = config.item_quality_std / config.signal_strength
    seen, mean = quality_posterior_mean(world, Interactions(users, videos, labels), rate, config.signal_strength, quality_std)
    sightings = np.bincount(videos, minlength=world.num_videos)[seen]
    often = sightings >= 200
    assert often.sum() > 20
    assert np.corrcoef(mean[often], world.quality[seen][often])[0, 1] > 0.9
    # One sighting says little: a click moves the posterior mean up, a skip down, both within one
    # prior standard deviation.
    one = [quality_posterior_mean(world, Interactions(users[:1], videos[:1], np.full((1, 8), label, np.float32)),
                                  rate, config.signal_strength, quality_std)[1][0] for label in (1.0, 0.0)]
    assert 0.0 < one[0] < quality_std and -quality_std < one[1] < 0.0


def test_bayes_posterior_finds_the_cluster_when_each_user_watches_one():
    """Each user likes one cluster and nearly every exposure is drawn from it: being shown to a user
    reveals the video's cluster, with no click to tell (none in these logs), so the posterior's most
    likely cluster is the true one."""
    config = signal_config("item", taste_exposure=0.99)
    rng = np.random.default_rng(2)
    world = World.draw(rng, 5e-5, config)
    one_hot = np.eye(world.taste.shape[1])[world.taste.argmax(axis=1)]
    world = replace(world, taste=one_hot)
    users = rng.integers(0, world.num_users, 3000)
    videos = world.sample_videos(rng, users, config.taste_exposure, config.popularity_exponent)
    labels = np.zeros((len(users), 8), np.float32)
    training, pairs = (Interactions(users[s], videos[s], labels[s]) for s in (slice(0, 2000), slice(2000, None)))
    probability, cluster_found = bayes_click_probability(world, config, training, pairs, config.rates[0])
    assert cluster_found.mean() > 0.9
    assert np.all((probability > 0) & (probability < 1))


def test_candidate_sightings_count_training_exposures_per_candidate_video():
    training = np.array([5, 3, 5, 5, 8, 3])
    candidates = np.array([5, 7, 3, 8, 5, 2])
    sightings = candidate_sightings(training, candidates)
    assert sightings.tolist() == [3, 0, 2, 1, 3, 0]
    assert candidate_sightings(np.array([], np.int64), candidates).tolist() == [0] * 6
    buckets = dict(sighting_buckets(np.array([0, 1, 2, 4, 5, 19, 20, 300])))
    assert {label: rows.nonzero()[0].tolist() for label, rows in buckets.items()} == {
        "0": [0], "1": [1], "2-4": [2, 3], "5-19": [4, 5], "20+": [6, 7]}


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    return build_processed(tmp_path_factory.mktemp("bounds"), scale=0.002, seed=3)


def _run(processed, tmp_path, seed):
    out = tmp_path / f"bounds_{seed}.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmark.quality.bounds", "--data_dir", str(processed),
         "--scale", "0.002", "--seed", str(seed), "--signal", "mixed", "--output", str(out)],
        capture_output=True, text=True, env=subprocess_env(), timeout=600,
    )
    return result, out


def test_quality_bounds_script_orders_the_oracle_above_its_parts(processed, tmp_path):
    result, out = _run(processed, tmp_path, seed=3)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    aucs = report["auc"]
    for part in ("taste alone", "quality alone", "propensity alone", "propensity + quality from sightings",
                 "taste, true clusters", "Bayes: world known, videos from sightings"):
        assert 0.0 < aucs[part] < aucs["oracle affinity"], part
    assert aucs["propensity + quality from sightings"] > aucs["propensity alone"]
    assert aucs["Bayes: world known, videos from sightings"] > aucs["propensity alone"]
    rows = report["bayes_by_sightings"]
    assert sum(row["candidates"] for row in rows) == report["candidates"]
    seen = [row for row in rows if row["sightings"] != "0" and row["candidates"]]
    assert seen and all(row["cluster_recovered"] > 2 / 64 for row in seen)  # far better than a guess
    assert "oracle affinity" in result.stdout


def test_quality_bounds_refuses_data_of_another_world(processed, tmp_path):
    result, out = _run(processed, tmp_path, seed=4)
    assert result.returncode == 2
    assert "was not made by data.synthetic --scale 0.002 --seed 4 --signal mixed" in result.stderr
    assert not out.exists()


def test_quality_bounds_names_a_missing_data_dir(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmark.quality.bounds", "--data_dir", str(tmp_path / "nope"),
         "--scale", "0.002", "--seed", "3", "--signal", "mixed", "--output", str(tmp_path / "out.json")],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )
    assert result.returncode == 2 and "error:" in result.stderr and "nope" in result.stderr
    assert not (tmp_path / "out.json").exists()
