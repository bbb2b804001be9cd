"""benchmark/quality/tag_probe.py: on generated sequential data the tags carry click signal that random tags do not, and
the stack of the tag counts on a scorer adds what the scorer does not read."""
from __future__ import annotations

import json

import numpy as np

from benchmark.quality.tag_probe import cross_fitted_stack, main, probe
from data.dataset import InferenceDataset
from helpers import build_processed
from model.baselines.affinity import logistic_fit
from model.metrics import auc
from model.video_tags import VideoTagTable


def test_tags_carry_the_sequential_signal_and_random_tags_do_not(tmp_path, capsys):
    dataset = InferenceDataset(build_processed(tmp_path, scale=0.002, seed=3, signal="sequential"))
    tags = VideoTagTable.from_dataset_dir(dataset.root)
    result = probe(dataset, tags, window=128, split_date=20220422)
    assert result["candidates"] > 1000
    assert result["same_tag_events"] > 0.58 and result["same_tag_click_rate"] > 0.55
    shuffled = VideoTagTable(tags.video_ids, np.random.default_rng(0).permutation(tags.tag_rows), tags.tags)
    at_random = probe(dataset, shuffled, window=128, split_date=20220422)["same_tag_events"]
    assert at_random < 0.55  # a little above chance: a video shown again shares its own tag
    assert result["same_tag_events"] - at_random >= 0.08
    assert main(["--data_dir", str(dataset.root), "--output", str(tmp_path / "p.json")]) == 0
    assert "same_tag_events" in capsys.readouterr().out and (tmp_path / "p.json").is_file()


def test_the_stack_scores_each_half_of_the_users_with_the_other_halfs_fit():
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(40), 30)
    labels = rng.random(users.size) < 0.3
    scores = rng.normal(size=users.size)
    features = np.column_stack([labels + rng.normal(0, 0.5, users.size), rng.normal(size=users.size)])
    stacked = cross_fitted_stack(scores, features, labels, users)
    assert auc(stacked, labels) > auc(scores, labels) + 0.2  # the informative feature is picked up
    flipped = labels.copy()
    even = users % 2 == 0
    flipped[even] = ~flipped[even]  # the even users' labels change: their own scores must not
    again = cross_fitted_stack(scores, features, flipped, users)
    np.testing.assert_array_equal(again[even], stacked[even])
    assert not np.array_equal(again[~even], stacked[~even])


def test_the_probe_stacks_the_tag_counts_on_a_baseline(tmp_path, capsys):
    dataset = InferenceDataset(build_processed(tmp_path, scale=0.002, seed=3, signal="sequential"))
    out = tmp_path / "p.json"
    assert main(["--data_dir", str(dataset.root), "--baselines", "item popularity", "--stack_windows", "32", "256",
                 "--resamples", "100", "--output", str(out)]) == 0
    gains = json.loads(out.read_text())["stacked"]["item popularity"]["gain_with_tag_counts"]
    assert set(gains) == {"32", "256"}
    for gain in gains.values():  # popularity knows nothing of the user; the tags of the history do
        assert gain["low"] > 0.02 and gain["resamples"] == 100
    assert "item popularity: click AUC" in capsys.readouterr().out


def test_the_logistic_fit_recovers_the_weights_it_was_drawn_with():
    rng = np.random.default_rng(1)
    design = rng.normal([2.0, -1.0], [3.0, 0.5], size=(40_000, 2))
    labels = (rng.random(40_000) < 1 / (1 + np.exp(-(design @ [0.8, -2.0] + 0.3)))).astype(np.float64)
    w = logistic_fit(design, labels, l2=0.0)
    p = 1 / (1 + np.exp(-(design @ w[:-1] + w[-1])))
    # the maximum likelihood: the score equations hold, and the weights are near those drawn with
    np.testing.assert_allclose(np.column_stack([design, np.ones(len(design))]).T @ (p - labels), 0.0, atol=1e-6)
    np.testing.assert_allclose(w, [0.8, -2.0, 0.3], atol=0.2)
