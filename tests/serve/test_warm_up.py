"""Kernel warm-up at node start: /health reports it, and it runs exactly the kernel variants serving then meets."""
from __future__ import annotations

import asyncio
import json

import pytest

from benchmark.harness.visits import visit_queries
from model.attention import recording_variants, triton_attention
from serve.engine import EngineConfig, open_engine
from serve.node import Node


def engine_for(artifacts, **overrides):
    processed, checkpoint = artifacts
    return open_engine(EngineConfig(str(processed), str(checkpoint), async_offload=False, **overrides))


def replay(engine, max_requests: int = 24, batch_size: int = 4) -> int:
    """Score the dataset's first visits in batches, as the node would; returns how many were scored."""
    indices = engine.history.request_indices(max_requests=max_requests)
    queries = dict(zip(indices.tolist(), visit_queries(engine.history, indices)))
    scored = 0
    for batch in engine.history.batches(indices, batch_size):
        results = engine.score_batch([queries[i] for i in batch.tolist()])
        scored += sum(not isinstance(r, Exception) for r in results)
    return scored


def test_health_reports_the_warm_up(serving_artifacts):
    engine = engine_for(serving_artifacts)
    try:
        warmed = engine.warm_up()
        node = Node(engine, "n1", max_batch_size=4, max_wait_s=0.001, max_queue=8)
        response = asyncio.run(node.health(None))
        body = json.loads(response.body)
    finally:
        engine.shutdown()
    assert response.status == 200 and body["cuda_graphs"] is False  # CPU: graphs are off by default
    report = body["warm_up"]
    assert report == warmed.as_dict() and report["backend"] == "blocked" and report["cuda_graphs"] is False
    assert report["seconds"] > 0 and report["forwards"] == 2  # a node serves through its cache only
    page_size = engine.cache.config.page_size
    assert report["variants"] == [{"backend": "blocked", "dtype": "float32", "key_dtype": "float32",
                                   "head_dim": engine.model.config.head_dim, "page_size": page_size}]


@pytest.mark.parametrize("backend", ["blocked", "triton"])
def test_the_warm_up_runs_exactly_the_variants_serving_meets(serving_artifacts, backend):
    """Recorded both ways: the backend's own KernelVariants and, for Triton, the specialisation keys
    Triton's compile cache uses (model/kernel_variants.py); serving after the warm-up meets none it lacks."""
    if backend == "triton" and not triton_attention.available():
        pytest.skip("triton is not installed")
    from model.kernel_variants import TritonLaunches

    engine = engine_for(serving_artifacts)
    try:
        engine.model.attention_backend = backend
        with TritonLaunches() as warm_launches:
            warmed = engine.warm_up()
        with TritonLaunches() as serve_launches, recording_variants() as met:
            assert replay(engine) > 0
        assert engine.cache.stats().tokens_reused > 0  # users came back: the replay continued cached windows
    finally:
        engine.shutdown()
    assert set(warmed.variants) == met and len(met) == 1
    if backend == "triton":
        assert serve_launches.keys and serve_launches.variants == warm_launches.variants
    else:
        assert not warm_launches.keys and not serve_launches.keys


def test_a_cuda_graphs_flag_that_cannot_be_honoured_is_refused(serving_artifacts):
    """--cuda_graphs on a CPU node fails its start (main answers exit 2) instead of serving eagerly."""
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        engine_for(serving_artifacts, cuda_graphs=True)
    engine = engine_for(serving_artifacts, cuda_graphs=False)
    engine.shutdown()
    assert engine.session.graphs is None


def test_node_flags_default_cuda_graphs_to_the_device():
    from serve.node import build_parser, main

    parse = build_parser().parse_args
    base = ["--checkpoint", "c", "--port", "8001", "--data_dir", "d"]
    assert parse(base).cuda_graphs is None  # resolved by use_cuda_graphs: on for CUDA with triton
    assert parse([*base, "--cuda_graphs"]).cuda_graphs is True
    assert parse([*base, "--no-cuda_graphs"]).cuda_graphs is False
    with pytest.raises(SystemExit) as refused:  # refused before the slow start
        main([*base, "--cuda_graphs", "--device", "cpu"])
    assert refused.value.code == 2


def test_warm_up_visits_leave_the_node_cache_untouched(serving_artifacts):
    """The warm-up's user 0 goes through a private cache: the node's cache holds no user afterwards."""
    engine = engine_for(serving_artifacts)
    try:
        engine.warm_up()
        start, length = engine.cache.get_user_kvdata_info([0])
        stats = engine.cache.stats()
    finally:
        engine.shutdown()
    assert int(length[0]) == 0 and int(start[0]) == 0
    assert (stats.users_on_device, stats.users_on_host, stats.hits, stats.misses) == (0, 0, 0, 0)
