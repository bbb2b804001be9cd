"""benchmark/quality/sequence_bounds.py: on sequential data, what the order of a user's history is worth."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from benchmark.quality.sequence_bounds import (
    AS_BAG,
    FROM_TAGS,
    IN_ORDER,
    NO_SEQUENCE,
    ORACLE,
    TAG_CLUSTERS,
    TAG_ROWS,
    TRUE_CLUSTERS,
    ClusterReading,
    order_bounds,
    sequence_scores,
)
from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE
from data.synthetic import generate, signal_config
from helpers import build_processed, subprocess_env
from model.quality import quality_split
from model.video_tags import VideoTagTable

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
    aucs, gains = order_bounds(summary.world, summary.sequence, dataset, split, permutations=32)
    assert aucs[ORACLE] >= aucs[IN_ORDER] > aucs[AS_BAG] > aucs[NO_SEQUENCE]
    assert set(gains) == {TRUE_CLUSTERS}
    assert gains[TRUE_CLUSTERS] == pytest.approx(aucs[IN_ORDER] - aucs[AS_BAG]) and gains[TRUE_CLUSTERS] > 0.03


def test_clusters_read_from_tags_know_less_than_the_truth_and_order_still_pays(world_and_data):
    """Tags name the cluster for 80% of the videos: the history's rows read from them score below
    their rows with the true clusters, and the order still beats the bag. (The affinity alone is near
    chance on this data's broad tastes, either way.)"""
    summary, dataset, split = world_and_data
    tags = VideoTagTable.from_dataset_dir(dataset.root)
    aucs, gains = order_bounds(summary.world, summary.sequence, dataset, split, permutations=32, tags=tags)
    assert set(TAG_ROWS) <= set(aucs)
    for name in (IN_ORDER, AS_BAG):
        assert aucs[name + FROM_TAGS] < aucs[name] - 0.02
    assert aucs[IN_ORDER + FROM_TAGS] > aucs[AS_BAG + FROM_TAGS] > aucs[NO_SEQUENCE + FROM_TAGS]
    assert gains[TAG_CLUSTERS] == pytest.approx(aucs[IN_ORDER + FROM_TAGS] - aucs[AS_BAG + FROM_TAGS])


def test_a_reading_from_tags_samples_the_posterior_of_the_tag(world_and_data):
    """A tag naming each cluster reads the truth; a tag shared by every video reads the clusters'
    prior (their video counts); a video the table lacks reads the prior too."""
    world = world_and_data[0].world
    videos = np.arange(len(world.video_cluster))
    perfect = ClusterReading.from_tags(world, VideoTagTable.from_pairs(videos, world.video_cluster + 100))
    uniform = np.random.default_rng(0).random((4, len(videos)))
    np.testing.assert_array_equal(perfect.clusters(videos, uniform), np.broadcast_to(world.video_cluster, uniform.shape))
    k = world.taste.shape[1]
    prior = np.bincount(world.video_cluster, minlength=k) / len(videos)
    for table in (VideoTagTable.from_pairs(videos, np.zeros_like(videos)), VideoTagTable.from_pairs(videos[:0], videos[:0])):
        drawn = ClusterReading.from_tags(world, table).clusters(np.zeros(20_000, np.int64),
                                                                 np.random.default_rng(1).random((1, 20_000)))
        assert drawn.min() >= 0 and drawn.max() < k
        np.testing.assert_allclose(np.bincount(drawn.ravel(), minlength=k) / drawn.size, prior, atol=0.02)


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
        [sys.executable, "-m", "benchmark.quality.bounds", "--data_dir", str(dataset.root),
         "--scale", str(SCALE), "--seed", str(SEED), "--signal", "sequential", "--max_eval_requests", "60",
         "--output", str(out)],
        capture_output=True, text=True, env=subprocess_env(), timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["auc"]) == {ORACLE, IN_ORDER, AS_BAG, NO_SEQUENCE, *TAG_ROWS}
    assert report["order_gain"][TRUE_CLUSTERS] == pytest.approx(report["auc"][IN_ORDER] - report["auc"][AS_BAG])
    assert "order is worth +" in result.stdout and f"with {TAG_CLUSTERS}" in result.stdout
    shares = report["candidate_share_by_sightings"]  # every evaluated candidate in exactly one range
    assert list(shares) == ["0", "1", "2-4", "5-19", "20+"] and sum(shares.values()) == pytest.approx(1.0)
    assert "candidates by their video's training sightings: 0 " in result.stdout
