"""The order ablation (model/order_ablation.py, benchmark/quality/order_ablation.py): what each variant feeds
the model, and what it reports."""
from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from benchmark.quality.order_ablation import main as ablation_main
from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, beijing_midnight_ms
from helpers import Visit, build_processed, make_batch, random_histories, sensitive_model, tiny_config
from model.checkpoint import save_checkpoint
from model.config import config_for_dataset
from model.order_ablation import AS_LOGGED, SHUFFLED, format_ablation, order_ablation, shuffle_within_windows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> InferenceDataset:
    root = build_processed(tmp_path_factory.mktemp("ablation"), scale=0.002, seed=5)
    return InferenceDataset(root, video_counters_until_ms=beijing_midnight_ms(DEFAULT_SPLIT_DATE))


def _evaluated(dataset: InferenceDataset, count: int = 24) -> np.ndarray:
    return dataset.request_indices(from_time_ms=beijing_midnight_ms(DEFAULT_SPLIT_DATE), max_requests=count)


def test_shuffling_permutes_each_users_events_and_leaves_their_times():
    rng = np.random.default_rng(0)
    histories = random_histories(rng, 3, (30, 50), tiny_config())
    batch = make_batch(histories, [Visit(u, len(h.video_ids), rng.integers(0, 99, 4)) for u, h in histories.items()])
    shuffled = shuffle_within_windows(batch, np.random.default_rng(1))
    np.testing.assert_array_equal(shuffled.timestamps_ms, batch.timestamps_ms)
    np.testing.assert_array_equal(shuffled.candidate_video_ids, batch.candidate_video_ids)
    bounds = np.r_[0, np.cumsum(batch.history_lengths)]
    for lo, hi in itertools.pairwise(bounds):
        before = Counter(zip(batch.video_ids[lo:hi].tolist(), batch.action_weights[lo:hi].tolist()))
        after = Counter(zip(shuffled.video_ids[lo:hi].tolist(), shuffled.action_weights[lo:hi].tolist()))
        assert before == after  # the same events, (video, action) kept together, within the same user
        assert not np.array_equal(shuffled.video_ids[lo:hi], batch.video_ids[lo:hi])


def test_each_variant_reports_its_auc_change_over_users_and_its_logit_change(dataset):
    model = sensitive_model(config_for_dataset("tiny", dataset))
    indices = _evaluated(dataset)
    result = order_ablation(model, dataset, indices, last_k=(0, 4), progress=False, resamples=200)
    assert set(result.variants) == {AS_LOGGED, SHUFFLED, "history-free", "last 4"}
    logged = result.variants[AS_LOGGED]
    assert logged.mean_abs_delta == 0.0 and logged.click_auc_change is None
    users = len(np.unique(dataset.requests.user_id[indices]))
    for name in (SHUFFLED, "history-free", "last 4"):
        variant = result.variants[name]
        assert variant.mean_abs_delta > 0  # this model reads every event, and where it sits
        change = variant.click_auc_change
        assert change.estimate == pytest.approx(variant.click_auc - logged.click_auc, abs=1e-12)
        assert change.low <= change.estimate <= change.high and change.groups == users
    assert result.num_requests == len(indices) and result.click_logit_std > 0
    text = format_ablation(result)
    assert "Δ click AUC (95% over users)" in text and f"{result.variants[SHUFFLED].click_auc_change.low:+.4f}" in text
    json.dumps(result.to_json())  # every figure serialises


def test_the_script_writes_every_variant_and_refuses_bad_options(dataset, tmp_path, capsys):
    model = sensitive_model(config_for_dataset("tiny", dataset))
    save_checkpoint(model, tmp_path / "ckpt")
    out = tmp_path / "ablation.json"
    assert ablation_main(["--data_dir", str(dataset.root), "--checkpoint", str(tmp_path / "ckpt"), "--last_k", "0",
                          "--max_requests", "16", "--resamples", "100", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_requests"] == 16
    shuffled = report["variants"][SHUFFLED]
    assert shuffled["click_auc_change"]["resamples"] == 100
    assert report["variants"]["history-free"]["click_auc"] == pytest.approx(
        report["variants"][AS_LOGGED]["click_auc"] + report["variants"]["history-free"]["click_auc_change"]["estimate"])
    assert "history-free" in capsys.readouterr().out
    assert ablation_main(["--data_dir", str(dataset.root), "--checkpoint", str(tmp_path / "ckpt"), "--last_k", "0",
                          "--max_requests", "16", "--resamples", "100", "--no_shuffle", "--output", str(out)]) == 0
    unshuffled = json.loads(out.read_text())["variants"]
    assert list(unshuffled) == [AS_LOGGED, "history-free"]  # no shuffled pass, the others as before
    assert unshuffled["history-free"] == report["variants"]["history-free"]
    assert SHUFFLED not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ablation_main(["--data_dir", str(dataset.root), "--checkpoint", str(tmp_path / "ckpt"), "--resamples", "0"])
    assert "--resamples must be >= 1, got 0" in capsys.readouterr().err

