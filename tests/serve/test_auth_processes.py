"""Authentication through real processes, started as deploy/k8s starts them: a node that takes only
the routers' token, a router that checks its clients' tokens and sends the routers' token on."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from benchmark.harness.launch import start_node, start_router, wait_healthy
from data.dataset import InferenceDataset
from serve.client import ScoreClient
from serve.protocol import RequestError

pytestmark = pytest.mark.slow
SCORER, ROUTERS = "c" * 32, "r" * 32


def call(url: str, path: str, doc: object | None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"{url}{path}", None if doc is None else json.dumps(doc).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_client_scores_through_the_router_and_nobody_reaches_the_node_without_the_routers_token(
        serving_artifacts, tmp_path):
    data_dir, checkpoint = serving_artifacts
    (tmp_path / "clients.tokens").write_text(f"checkout score {SCORER}\n")
    (tmp_path / "node.token").write_text(f"{ROUTERS}\n")
    node = start_node(data_dir, checkpoint, tmp_path / "logs", extra_args=[
        "--router_token_file", str(tmp_path / "node.token"), "--max_candidates", "64"])
    router = start_router([node.address], "round-robin", tmp_path / "logs", extra_args=[
        "--client_tokens", str(tmp_path / "clients.tokens"), "--node_token_file", str(tmp_path / "node.token")])
    try:
        wait_healthy([node, router], timeout_s=240)  # /health is open on both
        dataset = InferenceDataset(data_dir)
        user = int(dataset.requests.user_id[0])
        visit = {"user_id": user, "request_time_ms": int(dataset.requests.time_ms[0]),
                 "candidate_video_ids": [int(v) for v in dataset.candidate_video_ids(np.array([0]))[0][:4]]}
        assert ScoreClient([router.url], token=SCORER).score(visit).body["user_id"] == user
        with pytest.raises(RequestError, match="Bearer") as refused:  # refusals are not retried
            ScoreClient([router.url]).score(visit)
        assert refused.value.status == 401
        assert call(router.url, "/events", {"events": []}, SCORER)[0] == 403
        status, body = call(node.url, "/score", visit, SCORER)  # a client's token is not the routers'
        assert status == 401 and body["error"]["code"] == "unauthorized"
        assert call(node.url, "/score", visit)[0] == 401
        assert call(node.url, "/score", visit, ROUTERS)[0] == 200
        assert call(node.url, "/health", None)[0] == 200
    finally:
        router.stop(timeout_s=10)
        node.stop(timeout_s=30)
