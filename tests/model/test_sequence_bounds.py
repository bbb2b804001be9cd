"""benchmark/sequence_bounds.py: on sequential data, what the order of a user's history is worth."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from data.dataset import InferenceDataset
from data.synthetic import generate, signal_config
from helpers import REPO_ROOT, build_processed, subprocess_env
from model.quality import quality_split
from model.train import DEFAULT_SPLIT_DATE
from sequence_bounds import AS_BAG, IN_ORDER, NO_SEQUENCE, ORACLE, order_bounds, sequence_scores

SCALE, SEED = 0.002, 3


@pytest.fixture(scope="module")
def world_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence")
    processed = build_processed(root, scale=SCALE, seed=SEED, signal="sequential")
    summary = generate(root / "again", SCALE, SEED, signal_config("sequential"), progress=False)
    dataset = InferenceDataset(processed)
    return summary, dataset, quality_split(dataset, DEFAULT_SPLIT_DATE)


def test_order_aware_scores_beat_the_order_free_bound(world_and_data):
    summary, dataset, split = world_and_data
    aucs, gain = order_bounds(summary.world, summary.sequence, dataset, split, permutations=32)
    assert aucs[ORACLE] >= aucs[IN_ORDER] > aucs[AS_BAG] > aucs[NO_SEQUENCE]
    assert gain == pytest.approx(aucs[IN_ORDER] - aucs[AS_BAG]) and gain > 0.03


def test_history_in_order_is_the_exact_sequential_part_at_the_visit_start(world_and_data):
    """A visit's first candidate has seen nothing but the history, so the order-aware score (traces
    summed from the history's slots) is its true logit (replayed event by event); later candidates
    have also seen the visit's earlier events, which no scorer of the history knows."""
    summary, dataset, split = world_and_data
    scores = sequence_scores(summary.world, summary.sequence, dataset, split.eval_requests, permutations=4)
    counts = dataset.requests.num_candidates[split.eval_requests]
    first = np.r_[0, np.cumsum(counts)[:-1]]
    np.testing.assert_allclose(scores[IN_ORDER][first], scores[ORACLE][first], atol=1e-4)
    later = np.setdiff1d(np.arange(len(scores[ORACLE])), first)
    assert np.mean(np.abs(scores[IN_ORDER][later] - scores[ORACLE][later]) > 1e-3) > 0.5


def test_quality_bounds_script_reports_what_the_order_is_worth(world_and_data, tmp_path):
    """The script redraws the sequential world, checks it against the data (as for the other signals:
    tests/model/test_quality_bounds.py) and prints the order rows instead of the sightings rows."""
    _summary, dataset, _split = world_and_data
    out = tmp_path / "bounds.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmark" / "quality_bounds.py"), "--data_dir", str(dataset.root),
         "--scale", str(SCALE), "--seed", str(SEED), "--signal", "sequential", "--max_eval_requests", "60",
         "--output", str(out)],
        capture_output=True, text=True, env=subprocess_env(), timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["auc"]) == {ORACLE, IN_ORDER, AS_BAG, NO_SEQUENCE}
    assert report["order_gain"] == pytest.approx(report["auc"][IN_ORDER] - report["auc"][AS_BAG])
    assert "order is worth +" in result.stdout
