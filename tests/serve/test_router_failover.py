"""The router's failover over fake nodes: busy nodes are skipped, and when all are busy the client hears so."""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from benchmark.harness.launch import free_port
from serve.http_routes import Request
from serve.metrics import parse_samples
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


def test_requests_to_a_node_the_probe_takes_out_are_retried_elsewhere_at_once():
    """A node that hangs: the forward already sent to it is abandoned when the probe takes it out, and
    the visit goes to the other node, well before --forward_timeout_s; no node is asked twice."""
    hung_port, good_port = free_port(), free_port()
    asked: list[int] = []
    hung = asyncio.Event()

    async def main():
        def fake_node(port: int, name: str) -> web.Application:
            async def score(request):
                asked.append(port)
                if port == hung_port:
                    hung.set()
                    await asyncio.sleep(3600)
                return web.json_response({"scores": [[0.5]]})

            async def health(request):
                if port == hung_port and hung.is_set():
                    await asyncio.sleep(3600)
                return web.json_response({"node_id": name, "model_fingerprint": "fp"})

            app = web.Application()
            app.router.add_post("/score", score)
            app.router.add_get("/health", health)
            return app

        runners = [await _serve(fake_node(hung_port, "hung"), hung_port),
                   await _serve(fake_node(good_port, "good"), good_port)]
        pool = NodePool([f"127.0.0.1:{hung_port}", f"127.0.0.1:{good_port}"], probe_timeout_s=0.2)
        router = Router(pool, make_policy("round-robin"), forward_timeout_s=60.0, probe_interval_s=0.1)
        await router.start()
        try:
            # bounded: without the abandon this waits for the 60 s forward timeout
            response = await asyncio.wait_for(router.score(Request("POST", "/score", {}, BODY)), 20)
            return response, pool.describe(), parse_samples(router.registry.render())
        finally:
            await router.stop()
            for runner in runners:
                await runner.cleanup()

    response, nodes, samples = asyncio.run(main())
    assert response.status == 200 and dict(response.headers)["X-Routed-To"] == "good"
    assert asked == [hung_port, good_port]
    assert [n["up"] for n in nodes] == [False, True] and "health probe failed" in nodes[0]["last_error"]
    assert samples[f'hstu_router_abandoned_total{{node="127.0.0.1:{hung_port}"}}'] == 1


def test_a_route_query_with_a_non_ascii_digit_is_a_400():
    router = Router(NodePool(["127.0.0.1:1"]), make_policy("round-robin"))
    for tail in ("²", "9" * 30, "-1"):
        response = asyncio.run(router.route(Request("GET", f"/route/{tail}", {}, b"", tail)))
        assert response.status == 400 and json.loads(response.body)["error"]["code"] == "invalid_field"
