"""benchmark/quality_bounds.py: the generator's own quantities as scores, and the quality posterior."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmark.quality_bounds import quality_posterior_mean
from data.synthetic_world import World, draw_actions, signal_config
from helpers import REPO_ROOT, build_processed, subprocess_env
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


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    return build_processed(tmp_path_factory.mktemp("bounds"), scale=0.002, seed=3)


def _run(processed, tmp_path, seed):
    out = tmp_path / f"bounds_{seed}.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmark" / "quality_bounds.py"), "--data_dir", str(processed),
         "--scale", "0.002", "--seed", str(seed), "--signal", "mixed", "--em_iterations", "20", "--output", str(out)],
        capture_output=True, text=True, env=subprocess_env(), timeout=600,
    )
    return result, out


def test_quality_bounds_script_orders_the_oracle_above_its_parts(processed, tmp_path):
    result, out = _run(processed, tmp_path, seed=3)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    aucs = report["auc"]
    for part in ("taste alone", "quality alone", "propensity alone", "propensity + quality from sightings",
                 "taste, true clusters", "taste, co-exposure clusters"):
        assert 0.0 < aucs[part] < aucs["oracle affinity"], part
    assert aucs["propensity + quality from sightings"] > aucs["propensity alone"]
    assert all(0.0 <= row["purity"] <= 1.0 for row in report["coexposure_purity"])
    assert "oracle affinity" in result.stdout


def test_quality_bounds_refuses_data_of_another_world(processed, tmp_path):
    result, out = _run(processed, tmp_path, seed=4)
    assert result.returncode == 2
    assert "was not made by data.synthetic --scale 0.002 --seed 4 --signal mixed" in result.stderr
    assert not out.exists()
