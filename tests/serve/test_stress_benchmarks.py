"""benchmark/serving/router_stress.py and benchmark/serving/soak.py in tiny modes, so that they cannot rot: they run
end to end and write the fields docs/serving.md quotes. Their figures are not checked here (timed
results on a shared CI machine would be flaky); the recorded runs are in docs/serving.md."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO_ROOT, subprocess_env
from kvcache.local_redis import redis_server_binary

pytestmark = pytest.mark.slow


def test_router_stress_tiny_mode_writes_its_ratios(tmp_path):
    out = tmp_path / "stress.json"
    subprocess.run([sys.executable, "-m", "benchmark.serving.router_stress", "--clients", "3", "--stream_mib", "1",
                    "--half_open", "50", "--holders", "2", "--latency_requests", "100", "--output", str(out)],
                   cwd=REPO_ROOT, env=subprocess_env(), check=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["rss_ratio"] > 0 and result["p99_ratio"] > 0
    assert result["idle_rss_mb"] > 0 and result["streaming"]["peak_rss_mb"] >= result["idle_rss_mb"] * 0.9
    assert result["half_open"]["held"] == 50 and result["half_open"]["refused_503"] == 0
    assert result["half_open"]["new_connection_status"] == 200


def test_soak_tiny_mode_runs_end_to_end_with_its_kills(tmp_path, serving_artifacts):
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    data_dir, checkpoint = serving_artifacts
    out = tmp_path / "soak.json"
    subprocess.run([sys.executable, "-m", "benchmark.serving.soak", "--data_dir", str(data_dir), "--checkpoint", str(checkpoint),
                    "--workdir", str(tmp_path), "--duration_s", "20", "--rate", "3", "--visits", "30",
                    "--down_s", "1", "--warmup_s", "2", "--window_s", "5", "--sample_s", "1", "--output", str(out)],
                   cwd=REPO_ROOT, env=subprocess_env(), check=True, timeout=180)
    result = json.loads(out.read_text())
    # a node takes longer to come back than the next kill's offset: the order of the "back"s varies
    assert sorted(e["event"] for e in result["events"]) == sorted(
        f"{verb} {what}" if verb == "kill" else f"{what} {verb}" for what in ("node", "router", "redis")
        for verb in ("kill", "back"))
    assert result["requests"] == 60 and result["answered"] + result["lost"] == 60 and result["wrong_logits"] == 0
    # No request lost, to a kill or to the re-plan race the first soak found (docs/serving.md, "Soak").
    assert result["lost"] == 0, result["errors"]
    assert result["windows"] and set(result["rss"]) == {"redis", "node0", "node1", "router0", "router1"}
    assert set(result["pages_at_end"]) == {"node0", "node1"}
    pages = result["pages_at_end"].values()
    assert all(p["pages_in_use"] == p["pages_owned"] for p in pages)  # no page in use that no user owns
    assert sum(p["pages_in_use"] for p in pages) > 0
    node_cache = [sample[3] for node in ("node0", "node1") for sample in result["rss"][node]]
    assert max(node_cache) > 0  # the host tier's bytes are read beside the RSS
    assert out.with_suffix(".png").stat().st_size > 0
