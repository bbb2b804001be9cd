"""Parity across process restarts and across inference nodes (persistent and Redis tiers)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from data.dataset import InferenceDataset
from helpers import assert_logits_close, build_processed, sensitive_model
from kvcache import KVCacheManager
from model.cache_config import kv_cache_config
from model.checkpoint import model_fingerprint, save_checkpoint
from model.config import config_for_dataset
from model.inference import InferenceSession


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    dataset = InferenceDataset(build_processed(root))
    cfg = config_for_dataset("tiny", dataset)
    model = sensitive_model(cfg, 0)
    save_checkpoint(model, root / "ckpt")
    return root, dataset, model


def cache_for(model, num_pages=300, **tiers) -> KVCacheManager:
    return KVCacheManager(kv_cache_config(model.config, num_pages=num_pages, host_capacity_bytes=1 << 20, **tiers))


def halves(dataset, count=60):
    """Two consecutive halves of a replay: users of the second half mostly return from the first."""
    indices = dataset.request_indices(max_requests=count)
    return indices[: count // 2], indices[count // 2:]


def serve_all(session, dataset, indices):
    return [session.serve(b) for b in dataset.batches(indices, 4)]


def assert_parity_and_reuse(results, model, dataset, indices):
    full = serve_all(InferenceSession(model, dataset), dataset, indices)
    for r, f in zip(results, full):
        assert_logits_close(r.logits, f.logits)
    assert sum(r.tokens_reused for r in results) > 0


RESTART_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from data.dataset import InferenceDataset
    from kvcache import KVCacheManager
    from model.cache_config import kv_cache_config
    from model.checkpoint import load_checkpoint
    from model.inference import InferenceSession
    data_dir, ckpt, kv_dir, indices = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    dataset, model = InferenceDataset(data_dir), load_checkpoint(ckpt).model
    cache = KVCacheManager(kv_cache_config(model.config, num_pages=300, host_capacity_bytes=1 << 20,
                                           persistent_dir=kv_dir))
    session = InferenceSession(model, dataset, kv_cache=cache)
    for batch in dataset.batches(np.array(indices), 4):
        session.serve(batch)
    cache.wait()
    cache.close()
""")


def test_restarted_process_reuses_the_persistent_tier(world, tmp_path):
    root, dataset, model = world
    first, second = halves(dataset)
    # Process 1 serves the first half and exits; this process is the restarted service.
    proc = subprocess.run(
        [sys.executable, "-c", RESTART_SCRIPT, str(dataset.root), str(root / "ckpt"), str(tmp_path / "kv"),
         json.dumps(first.tolist())], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    cache = cache_for(model, persistent_dir=str(tmp_path / "kv"))
    results = serve_all(InferenceSession(model, dataset, kv_cache=cache), dataset, second)
    assert_parity_and_reuse(results, model, dataset, second)
    assert cache.stats().onloaded_bytes > 0


def test_user_returning_to_another_node_reuses_its_kv(world, redis_server):
    _root, dataset, model = world
    first, second = halves(dataset)
    tiers = {"redis_url": redis_server, "redis_namespace": model_fingerprint(model)}
    node_a, node_b = cache_for(model, **tiers), cache_for(model, **tiers)
    serve_all(InferenceSession(model, dataset, kv_cache=node_a), dataset, first)
    node_a.wait()
    results = serve_all(InferenceSession(model, dataset, kv_cache=node_b), dataset, second)
    assert_parity_and_reuse(results, model, dataset, second)


def test_redis_outage_mid_replay_falls_back_to_recompute(world, private_redis_server):
    _root, dataset, model = world
    indices = dataset.request_indices(max_requests=60)
    # A device pool and host memory far below the working set: returning users need Redis.
    cache = cache_for(model, redis_url=private_redis_server.url, redis_namespace=model_fingerprint(model))
    session = InferenceSession(model, dataset, kv_cache=cache)
    batches = list(dataset.batches(indices, 4))
    results = [session.serve(b) for b in batches[: len(batches) // 2]]
    private_redis_server.stop()
    results += [session.serve(b) for b in batches[len(batches) // 2:]]
    full = serve_all(InferenceSession(model, dataset), dataset, indices)
    for r, f in zip(results, full):
        assert_logits_close(r.logits, f.logits)
    assert cache.stats().tier_failures > 0
