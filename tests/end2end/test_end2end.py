"""The whole pipeline on a tiny generated dataset: generate -> preprocess -> train -> replay both ways."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmark.serving import end2end
from benchmark.serving.end2end_args import build_parser, parse_args
from benchmark.serving.replay_setup import load_model
from data.dataset import InferenceDataset
from helpers import REPO_ROOT as ROOT
from helpers import build_processed
from model.train import main as train_main

EXAMPLE = ROOT / "benchmark" / "inference_end2end_example.py"  # the published entry point, run as a file


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    build_processed(root)
    assert train_main(["--data_dir", str(root / "processed"), "--checkpoint", str(root / "ckpt"),
                       "--preset", "tiny", "--max_train_requests", "40", "--batch_size", "8"]) == 0
    return root


def test_the_trainer_refuses_a_model_its_options_cannot_build(pipeline, tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    assert train_main(["--data_dir", str(pipeline / "processed"), "--checkpoint", str(checkpoint),
                       "--preset", "tiny", "--video_hash_size", "0"]) == 2
    assert "video_hash_size must be >= 1" in capsys.readouterr().err
    assert not checkpoint.exists()


def run_example(args: list[str]) -> int:
    return end2end.main(args + ["--quiet"])


def test_cached_and_full_recompute_agree_end_to_end(pipeline, tmp_path):
    out = tmp_path / "result.json"
    code = run_example(["--data_dir", str(pipeline / "processed"), "--checkpoint", str(pipeline / "ckpt"),
                        "--max_requests", "60", "--batch_size", "4", "--output", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    for key in ("num_requests", "speedup", "max_abs_logit_diff", "auc", "latency_ms", "tokens_computed", "cache"):
        assert key in result, key
    assert result["num_requests"] == 60
    # Both passes' kernel variants were run before either was timed: the cache's page size and contiguous keys.
    assert result["cuda_graphs"] is False  # the default on CPU
    warmed = result["kernel_warm_up"]
    assert sorted(v["page_size"] for v in warmed["variants"]) == [0, result["cache_config"]["page_size"]]
    assert result["parity"] == "pass" and result["max_abs_logit_diff"] <= 1e-4
    for task, value in result["auc"]["kv cache"].items():
        other = result["auc"]["full recompute"][task]
        assert (value is None and other is None) or round(value, 4) == round(other, 4)
    assert result["tokens_computed"]["kv cache"] < result["tokens_computed"]["full recompute"]
    # The default device pool is a quarter of the working set: users were evicted and reloaded.
    assert result["cache"]["device_evictions"] > 0 and result["cache"]["onloaded_bytes"] > 0
    assert Path(result["plot"]).is_file() and Path(result["plot"]).stat().st_size > 0
    for p in ("p50", "p90", "p99"):
        assert result["latency_ms"]["kv cache"][p] > 0
    # The untimed probe counted each pass's ops: work was done, and no op made the host wait.
    for name in ("kv cache", "full recompute"):
        cost = result["serving_cost"][name]
        assert cost["batches_counted"] > 0 and cost["kernel_ops_per_batch"] > 0
        assert cost["ops_per_batch"] >= cost["kernel_ops_per_batch"]
        assert cost["sync_ops_per_batch"] == 0


def test_random_init_warns_and_no_compare_skips_the_full_pass(pipeline, tmp_path, caplog):
    out = tmp_path / "result.json"
    code = run_example(["--data_dir", str(pipeline / "processed"), "--preset", "tiny", "--no_compare",
                        "--max_requests", "10", "--output", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert "speedup" not in result and list(result["latency_ms"]) == ["kv cache"]
    assert "RANDOMLY INITIALISED" in caplog.text


def test_a_recipe_shapes_the_random_model_as_training_starts_it(pipeline, tmp_path):
    """`--recipe default` without a checkpoint serves what `model.train` starts from: ids, tags and side
    features, the tag-match term at its prior, the crop's window; and the cache stays exact for it."""
    from model.attention.relative_bias import TAG_MATCH_PRIOR
    from model.train_params import TrainParams

    out = tmp_path / "result.json"
    assert run_example(["--data_dir", str(pipeline / "processed"), "--preset", "tiny", "--recipe", "default",
                        "--max_requests", "24", "--batch_size", "4", "--no_cost_probe", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    model = result["model"]
    assert model["tag_match_bias"] is True and model["num_video_tags"] > 1
    assert model["side_feature_hash_size"] == TrainParams().side_feature_hash_size  # off by default
    assert model["attention_window"] == TrainParams().max_history_events
    assert model["video_hash_size"] > 1
    assert result["parity"] == "pass" and result["max_abs_logit_diff"] <= 1e-4
    assert 0.0 <= result["window_tokens_never_read_again"] < 1.0
    args = parse_args(build_parser(""), ["--data_dir", str(pipeline / "processed"), "--preset", "tiny",
                                         "--recipe", "default", "--attention_window", "16"])
    served = load_model(args, InferenceDataset(pipeline / "processed"))
    assert served.config.attention_window == 16  # --attention_window still wins
    assert all(torch.all(layer.relative_bias.tag_match.detach() == TAG_MATCH_PRIOR) for layer in served.layers)


def test_the_default_recipe_reads_what_the_data_has(pipeline, tmp_path):
    """On data without video features, the default model has neither tags nor side features, and is served."""
    import shutil

    bare = tmp_path / "processed"
    shutil.copytree(pipeline / "processed", bare)
    (bare / "video_tags.parquet").unlink()
    (bare / "video_side_features.parquet").unlink()
    out = tmp_path / "r.json"
    assert run_example(["--data_dir", str(bare), "--preset", "tiny", "--recipe", "default", "--max_requests", "8",
                        "--batch_size", "4", "--no_cost_probe", "--output", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["num_video_tags"] == 0 and model["side_feature_hash_size"] == 0 and not model["tag_match_bias"]


def test_missing_checkpoint_is_refused(pipeline, tmp_path, capsys):
    code = run_example(["--data_dir", str(pipeline / "processed"), "--checkpoint", str(tmp_path / "none"),
                        "--output", str(tmp_path / "r.json")])
    assert code == 2
    assert "No checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_checkpoint_for_other_data_is_refused(pipeline, tmp_path, capsys):
    from model.checkpoint import load_checkpoint, save_checkpoint

    model = load_checkpoint(pipeline / "ckpt").model
    other = model.config.replace(user_feature_cardinalities=tuple(c + 1 for c in model.config.user_feature_cardinalities))
    from model.recommender import HSTURecommender

    save_checkpoint(HSTURecommender(other, video_tags=model.video_tags, side_features=model.side_features),
                    tmp_path / "other")
    code = run_example(["--data_dir", str(pipeline / "processed"), "--checkpoint", str(tmp_path / "other"),
                        "--output", str(tmp_path / "r.json")])
    assert code == 2
    assert "user-feature vocabularies" in capsys.readouterr().err


def test_directory_that_is_not_preprocessor_output_is_refused(pipeline, tmp_path, capsys):
    code = run_example(["--data_dir", str(pipeline / "raw"), "--checkpoint", str(pipeline / "ckpt"),
                        "--output", str(tmp_path / "r.json")])
    assert code == 2
    assert "manifest.json" in capsys.readouterr().err


def test_manifest_of_another_schema_version_is_refused(pipeline, tmp_path, capsys):
    import shutil

    copy = tmp_path / "processed"
    shutil.copytree(pipeline / "processed", copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 999
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code = run_example(["--data_dir", str(copy), "--checkpoint", str(pipeline / "ckpt"),
                        "--output", str(tmp_path / "r.json")])
    assert code == 2
    assert "schema" in capsys.readouterr().err.lower()


def test_cli_runs_as_a_script(pipeline, tmp_path):
    out = tmp_path / "cli.json"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--data_dir", str(pipeline / "processed"), "--checkpoint",
         str(pipeline / "ckpt"), "--max_requests", "12", "--output", str(out), "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "parity pass" in proc.stdout
    assert json.loads(out.read_text())["parity"] == "pass"


def test_persistent_tier_selected_by_flag(pipeline, tmp_path):
    out = tmp_path / "disk.json"
    args = ["--data_dir", str(pipeline / "processed"), "--checkpoint", str(pipeline / "ckpt"),
            "--max_requests", "30", "--batch_size", "4", "--kv_tier", "disk", "--kv_dir", str(tmp_path / "kv"),
            "--output", str(out)]
    assert run_example(args) == 0
    result = json.loads(out.read_text())
    assert result["parity"] == "pass" and result["cache_config"]["tier"] == "disk"
    assert any((tmp_path / "kv").rglob("*.kv"))  # the tier below memory received the K/V


def test_tier_flag_without_its_location_is_refused(pipeline, tmp_path, capsys):
    code = run_example(["--data_dir", str(pipeline / "processed"), "--checkpoint", str(pipeline / "ckpt"),
                        "--kv_tier", "redis", "--output", str(tmp_path / "r.json")])
    assert code == 2
    assert "--redis_url" in capsys.readouterr().err
