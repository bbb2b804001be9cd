"""Smoke test: the KV cache micro-benchmark runs end to end at tiny sizes (keeps it from rotting)."""
import json
import subprocess
import sys

from helpers import REPO_ROOT as ROOT


def test_benchmark_runs_quick(tmp_path):
    out = tmp_path / "kvcache_ops.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.kvcache.ops", "--quick", "--device", "cpu",
         "--output", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert set(results["append"]) == {"fp32", "bf16"}
    assert results["append"]["fp32"]["ratio_vs_copy"] > 0
    assert results["offload_reload"]["bf16"]["reload"]["ratio_vs_copy"] > 0
    assert results["prepare"]["large_over_small"] > 0
    assert "ratio vs copy_" in proc.stdout
