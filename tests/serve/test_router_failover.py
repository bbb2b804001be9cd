"""The router's failover over fake nodes: busy nodes are skipped, and when all are busy the client hears so."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from serve.http_routes import Request
from serve.launch import free_port
from serve.node_pool import NodePool
from serve.policies import make_policy
from serve.router import Router

BODY = json.dumps({"user_id": 7, "request_time_ms": 1_650_000_000_000, "candidate_video_ids": [1, 2]}).encode()


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)  # a hung handler is not waited for
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def _node(status: int, answer: dict, asked: list[int], port: int) -> web.AppRunner:
    async def score(request):
        asked.append(port)
        return web.json_response(answer, status=status)

    app = web.Application()
    app.router.add_post("/score", score)
    return await _serve(app, port)


def _route(answers: list[tuple[int, dict] | None]) -> tuple[int, dict, dict[str, str], list[int], list[int]]:
    """Fake nodes answering `answers` (None: nothing listens) behind a router -> (status, body, headers,
    node ports, ports asked in order)."""
    ports = [free_port() for _ in answers]
    asked: list[int] = []

    async def main():
        runners = [await _node(*a, asked, p) for a, p in zip(answers, ports) if a is not None]
        pool = NodePool([f"127.0.0.1:{p}" for p in ports])
        for node in pool.nodes:
            node.up = True  # as if the probe had seen them; the forwards find out the rest
        router = Router(pool, make_policy("round-robin"), forward_timeout_s=5.0)
        try:
            return await router.score(Request("POST", "/score", {}, BODY))
        finally:
            for conns in router._connections.values():
                conns.close()
            for runner in runners:
                await runner.cleanup()

    response = asyncio.run(main())
    return response.status, json.loads(response.body), dict(response.headers), ports, asked


OVERLOADED = (503, {"error": {"code": "overloaded", "message": "node is overloaded: queue full"}})


def test_a_busy_node_is_skipped_for_one_that_answers():
    status, body, headers, ports, asked = _route([OVERLOADED, (200, {"scores": [[0.5]]})])
    assert status == 200 and body == {"scores": [[0.5]]}
    assert sorted(asked) == sorted(ports) and headers["X-Routed-To"] == f"127.0.0.1:{ports[1]}"


def test_when_every_node_is_busy_the_client_hears_overloaded_not_an_outage():
    status, body, headers, ports, asked = _route([OVERLOADED, OVERLOADED])
    assert status == 503 and body["error"]["code"] == "overloaded"
    assert sorted(asked) == sorted(ports)  # each node asked once, none twice
    assert headers["X-Routed-To"] in {f"127.0.0.1:{p}" for p in ports}


def test_busy_and_unreachable_nodes_still_answer_overloaded():
    status, body, _, _, asked = _route([None, OVERLOADED])
    assert status == 503 and body["error"]["code"] == "overloaded" and len(asked) == 1


def test_when_no_node_answers_the_client_hears_no_node_available():
    status, body, _, _, asked = _route([None, None])
    assert status == 503 and body["error"]["code"] == "no_node_available" and asked == []
    assert "every node failed" in body["error"]["message"]


def test_a_route_query_with_a_non_ascii_digit_is_a_400():
    router = Router(NodePool(["127.0.0.1:1"]), make_policy("round-robin"))
    for tail in ("²", "9" * 30, "-1"):
        response = asyncio.run(router.route(Request("GET", f"/route/{tail}", {}, b"", tail)))
        assert response.status == 400 and json.loads(response.body)["error"]["code"] == "invalid_field"
