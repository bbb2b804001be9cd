"""`make gpu-report`'s dry run executes every step's CPU part and writes the report; the GPU plan fits its budget
and measures the issue's shapes (benchmark/gpu_report.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import gpu_report
from helpers import REPO_ROOT, subprocess_env


def test_the_gpu_plan_measures_the_target_shapes_within_the_budget(tmp_path):
    steps = {s.name: s for s in gpu_report.plan_steps(tmp_path / "report", tmp_path / "work", dry=False)}
    assert list(steps) == [*gpu_report.STEP_NAMES, *gpu_report.EXTRA_STEP_NAMES]
    assert list(gpu_report.STEP_NAMES) == ["runtime", "tests", "block", "launches", "end2end"]
    first_run = sum(steps[name].timeout_s for name in gpu_report.STEP_NAMES)
    assert first_run <= gpu_report.BUDGET_SECONDS - 60  # room to start and report
    assert "--device cuda" in " ".join(steps["study"].commands[0]) and "16384" in steps["study"].commands[0]
    block = " ".join(steps["block"].commands[0])
    for part in ("--device cuda", "--dtype bfloat16", "--cuda_graphs", "--batches 1 8 32", "--histories 4096",
                 "--new_tokens 128", "--candidates 256"):  # 3968 cached + 128 new + 256 candidates
        assert part in block, part
    replay = " ".join(steps["end2end"].commands[-1])
    assert "--dtype bfloat16" in replay and "--device cuda" in replay and "--no_compare" not in replay
    assert "--recipe default" in replay  # the shipped model's kernel variants: tag match, a 512-event window
    assert not any("--collect-only" in command for command in steps["tests"].commands)
    launches = " ".join(steps["launches"].commands[0])
    assert "--device cuda" in launches and "--dtype bfloat16" in launches and "--history 4096" in launches


@pytest.mark.slow
def test_the_dry_run_executes_every_step_and_reports(tmp_path):
    out = tmp_path / "report"
    command = [sys.executable, "-m", "benchmark.gpu_report", "--dry", "--output", str(out), "--work", str(tmp_path / "work")]
    run = subprocess.run(command, cwd=REPO_ROOT,
                         env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert report["dry"] and "dry run" in report["device"]
    assert steps["runtime"]["status"] == "failed" and "CPU build" in steps["runtime"]["output_tail"]
    assert all(steps[name]["status"] == "passed" for name in ("tests", "block", "launches", "end2end")), steps
    assert "collected" in steps["tests"]["output_tail"] or "tests collected" in steps["tests"]["output_tail"]
    assert [(r["history"], r["batch"]) for r in steps["block"]["result"]["rows"]] == [(64, 1), (64, 2)]
    assert steps["end2end"]["result"]["parity"] == "pass" and steps["end2end"]["result"]["speedup"] > 0
    assert steps["end2end"]["result"]["model"]["tag_match_bias"] is True
    # The CPU profiler's path: eager only (no graphs off CUDA), flat from B=1 to B=8.
    launches = steps["launches"]["result"]
    assert [(r["batch"], r["mode"]) for r in launches["rows"]] == [(1, "eager"), (8, "eager")]
    assert all(r["launches"] > 0 for r in launches["rows"]) and launches["eager_growth_1_to_8"] <= 1.3
    figures = {f["figure"]: f for f in report["figures"]}
    assert figures["end-to-end logit parity"]["met"] is True
    assert all(f["target"] is None for name, f in figures.items() if "block" in name)  # no H100 target on CPU
    markdown = Path(out / "report.md").read_text()
    assert markdown.startswith(f"# GPU report: {report['device']}") and "| end2end | passed |" in markdown
    # A few files, so that a runner returning at most eight files from a folder brings the whole report back.
    assert sorted(p.name for p in out.iterdir()) == ["block.json", "end2end.json", "end2end.png", "launches.json",
                                                     "report.json", "report.md"]


@pytest.mark.slow
def test_the_study_runs_when_named_and_reports_its_speedups(tmp_path):
    """`--steps study` (not in the first run's plan): the KV-reuse study into kv_study/, its speedups in the figures."""
    out = tmp_path / "report"
    assert gpu_report.main(["--dry", "--steps", "study", "--output", str(out), "--work", str(tmp_path / "work")]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["steps"]] == ["study"] and report["steps"][0]["status"] == "passed"
    assert (out / "kv_study" / "report.md").exists()
    speedups = [f for f in report["figures"] if f["figure"].startswith("KV study")]
    assert [f["figure"].rsplit(" ", 1)[1] for f in speedups] == ["16", "64"] and all(f["value"] > 0 for f in speedups)


def test_a_step_stops_at_its_scaled_limit_and_keeps_its_output(tmp_path):
    """--budget scales every step's limit: a step past it is reported as timed out, with what it printed."""
    step = gpu_report.Step("sleepy", "prints, then sleeps past its limit",
                           [[sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)"]], 100)
    result = gpu_report.run_step(step, tmp_path, scale=0.02)  # 2 s of the planned 100
    assert result.status == "timed out" and result.seconds < 15 and "started" in result.output_tail


def test_a_host_sync_in_the_forward_is_named_and_the_launches_still_counted(monkeypatch):
    """launch_count's path for a forward that synchronises (on CUDA, set_sync_debug_mode("error") raises):
    simulated on CPU by a check that raises as CUDA's does around the forward."""
    import argparse
    from contextlib import contextmanager

    from benchmark.model import launch_count
    from benchmark.workloads import add_model_flags, model_from_flags

    @contextmanager
    def raising(device):
        raise RuntimeError("called a synchronizing CUDA operation\nmore")
        yield

    monkeypatch.setattr(launch_count, "no_host_syncs", raising)
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    model = model_from_flags(parser, parser.parse_args(["--preset", "tiny", "--dtype", "float32", "--device", "cpu"]))
    rows = [r for b in (1, 2) for r in launch_count.measure(model, b, 48, 8, 4, graphs=None)]
    assert [r.host_sync for r in rows] == ["called a synchronizing CUDA operation"] * 2
    assert all(r.launches > 0 for r in rows)  # counted unchecked; each batch rolled back, so the next prepared
