"""benchmark/history/ingest.py runs end to end on tiny inputs and writes what it prints."""
from __future__ import annotations

import json

from benchmark.history.ingest import main
from kvcache.local_redis import redis_server_binary


def test_the_ingest_benchmark_measures_every_store_and_batch_size(tmp_path, capsys):
    stores = ["sqlite", f"sqlite://{tmp_path / 'given.sqlite'}"] + (["local-redis"] if redis_server_binary() else [])
    out = tmp_path / "ingest.json"
    argv = ["--events", "30", "--batch-sizes", "1", "10", "--workdir", str(tmp_path), "--out", str(out)]
    result = main([arg for store in stores for arg in ("--store", store)] + argv)
    assert json.loads(out.read_text()) == result
    assert [(r["batch_size"], r["events"]) for r in result["rows"]] == [(1, 30), (10, 30)] * len(stores)
    assert all(r["events_per_s"] > 0 for r in result["rows"])
    assert len(result["redis_bytes_per_event"]) == len(stores) - 2
    assert "events/s" in capsys.readouterr().out
