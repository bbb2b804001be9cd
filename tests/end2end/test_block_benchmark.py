"""benchmark/model/hstu_block.py and the benchmarks' shared model flags (benchmark/workloads.py)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from benchmark.model.hstu_block import layer_flops
from benchmark.workloads import add_model_flags, model_from_flags, visit_batches
from helpers import REPO_ROOT, subprocess_env
from model.config import preset


def _model(*flags: str):
    p = argparse.ArgumentParser()
    add_model_flags(p)
    return model_from_flags(p, p.parse_args(["--preset", "tiny", "--device", "cpu", *flags]))


def test_the_flop_count_of_a_windowed_layer_counts_only_the_keys_in_the_window():
    full, windowed = preset("tiny"), preset("tiny", attention_window=16)
    d, a = full.hidden_dim, full.attention_dim
    new, cached, candidates = 8, 100, 4
    projections, output = 2 * (new + candidates) * d * 4 * a, 2 * (new + candidates) * a * d
    every_key = sum(cached + i + 1 for i in range(new)) + candidates * (cached + new + 1)
    in_window = new * 16 + candidates * (16 + 1)  # every query's window is full: 100 keys are cached
    assert layer_flops(full, new, cached, candidates, True) == projections + 4 * a * every_key + output
    assert layer_flops(windowed, new, cached, candidates, True) == projections + 4 * a * in_window + output
    # A window longer than the history changes nothing.
    assert layer_flops(preset("tiny", attention_window=500), new, cached, candidates, True) == \
        layer_flops(full, new, cached, candidates, True)


def test_tag_match_flag_tags_every_benchmark_video_and_the_term_moves_the_scores():
    model = _model("--tag_match", "--attention_window", "16")
    assert model.config.tag_match_bias and model.config.attention_window == 16
    full, _incremental = visit_batches(model.config, batch=2, history=40, new=8, candidates=4)
    assert model.video_tags.rows(full.video_ids).min() > 0  # no video falls on the unknown tag
    with torch.no_grad():
        scores = model(full)
        for layer in model.layers:
            layer.relative_bias.tag_match.zero_()
        assert (model(full) - scores).abs().max() > 1e-3


def test_a_negative_window_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        _model("--attention_window", "-1")
    assert "--attention_window must be >= 0, got -1" in capsys.readouterr().err


def test_the_block_benchmark_runs_the_tag_matching_windowed_model(tmp_path):
    out = tmp_path / "block.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmark.model.hstu_block", "--preset", "tiny", "--device", "cpu", "--tag_match",
         "--attention_window", "16", "--histories", "64", "--batches", "1", "2", "--new_tokens", "8",
         "--candidates", "4", "--repeats", "1", "--output", str(out)],
        cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["history"], r["batch"]) for r in rows] == [(64, 1), (64, 2)]
    assert all(r["cached_sync_ops"] == 0 and r["cached_ms"] > 0 and r["full_ms"] > 0 for r in rows)
