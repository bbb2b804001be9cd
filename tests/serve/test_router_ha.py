"""Two routers over the same nodes: one is killed under load, and a client that retries on the
other loses no request and gets the offline replay's logits for every visit."""
from __future__ import annotations

import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from benchmark.harness.launch import Service, start_node, start_routers, wait_healthy, wait_until
from benchmark.harness.visits import query_body, visit_queries
from data.dataset import InferenceDataset
from helpers import assert_logits_close, offline_logits
from kvcache.local_redis import LocalRedisServer, redis_server_binary
from model.checkpoint import load_checkpoint
from serve.client import ScoreClient
from serve.metrics import parse_samples

pytestmark = pytest.mark.slow
NODE_ARGS = ["--kv_pages", "512", "--max_wait_ms", "1", "--heartbeat_s", "0.2", "--index_ttl_s", "1.0",
             "--sync_offload", "--max_candidates", "64"]
KILL_AFTER = 16  # answers before the first router is killed
REQUESTS = 64


def test_a_router_killed_under_load_loses_no_request_for_a_retrying_client(tmp_path, serving_artifacts):
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    data_dir, checkpoint = serving_artifacts
    redis = LocalRedisServer(tmp_path / "redis").start()
    services: list[Service] = []
    try:
        services += [start_node(data_dir, checkpoint, tmp_path / "logs", redis.url, extra_args=NODE_ARGS)
                     for _ in range(2)]
        routers = start_routers(2, [s.address for s in services], "kv-aware", tmp_path / "logs", redis.url,
                                extra_args=["--probe_interval_s", "0.2", "--forward_timeout_s", "20"])
        services += routers
        wait_healthy(services, timeout_s=240)

        dataset = InferenceDataset(data_dir)
        indices = dataset.request_indices(max_requests=REQUESTS)
        by_user: dict[int, list] = {}
        for query in visit_queries(dataset, indices):
            by_user.setdefault(query.user_id, []).append(query)
        client = ScoreClient([r.url for r in routers], timeout_s=20.0, deadline_s=60.0)
        answers: dict[str, object] = {}  # request id -> ClientAnswer
        answered_before_kill: set[str] = set()
        lock = threading.Lock()

        def serve_user(queries):  # a user's visits in order, users concurrently
            for query in queries:
                answer = client.score(json.loads(query_body(query)))
                with lock:
                    answers[query.request_id] = answer

        def kill_first_router():
            assert wait_until(lambda: len(answers) >= KILL_AFTER, timeout_s=120), "no load reached the routers"
            routers[0].kill()  # SIGKILL: a crash, in the middle of the load
            with lock:
                answered_before_kill.update(answers)

        with ThreadPoolExecutor(6) as pool:
            killer = pool.submit(kill_first_router)
            for done in [pool.submit(serve_user, queries) for queries in by_user.values()]:
                done.result()  # a lost request raises here (RoutersUnavailableError)
            killer.result()

        assert not routers[0].alive()
        assert sorted(answers) == sorted(str(i) for i in indices.tolist())  # every request answered once
        after_kill = [a for rid, a in answers.items() if rid not in answered_before_kill]
        assert len(after_kill) >= 2, "the kill came too late to test anything"
        assert any(a.attempts > 1 for a in after_kill), "no request was retried after the kill"
        # The first answer after the kill may have come from the dead router just before it died;
        # every request that started later went to the survivor.
        assert sum(a.router != routers[1].url for a in after_kill) <= 6
        expected = offline_logits(load_checkpoint(checkpoint).model, dataset, indices)
        for request_id, answer in answers.items():
            assert answer.body["request_id"] == request_id
            assert_logits_close(torch.tensor(answer.body["logits"]), expected[int(request_id)])
        with urllib.request.urlopen(f"{routers[1].url}/metrics", timeout=10) as resp:
            samples = parse_samples(resp.read().decode())
        assert samples['hstu_router_requests_total{code="200"}'] >= sum(a.router == routers[1].url for a in after_kill)
    finally:
        for service in reversed(services):
            service.stop(timeout_s=30)
        redis.stop()
