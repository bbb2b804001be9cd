"""The router: an HTTP front that forwards each score request to one node, chosen by a policy.

    python -m serve.router --nodes 127.0.0.1:8001,127.0.0.1:8002 --policy kv-aware \\
        --redis_url redis://127.0.0.1:6379/0 --port 8000

    POST /score    -> the chosen node's answer (header X-Routed-To: node id) | 400 malformed | 503 no node,
                      or 503 "overloaded" (a node's answer) when every node that answered is busy
    POST /events   -> a node's answer (it appends to the history store the nodes share) | 400 malformed
    GET  /health   -> 200 {"status": "ok", "policy", "nodes": [...]} | 503 when no node is up
    GET  /metrics  -> Prometheus text
    GET  /route/{user_id} -> where a request of the user would go now, and why (nothing is forwarded)
    With --client_tokens: 401 / 403 before any of the above but /health and /metrics, and with
    --events_per_s 429 past a client's events rate (serve/auth.py)

`kv-aware` reads the locality index (serve/locality_index.py) in the Redis of `--redis_url`,
under the fingerprint of the model the nodes report on /health, through an in-memory mirror
fed by the index's change channel (serve/index_mirror.py; Redis directly while the mirror is
out of sync); the other policies need no Redis.
A node whose connection fails or times out is taken out at once and the request goes to the
next choice among the others; a probe of every node's /health each `--probe_interval_s` takes
out silent nodes and brings back restarted ones. Malformed requests are answered here and never
reach a node. The router never imports torch: it starts in a second.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
import zlib

import aiohttp
import redis.asyncio as aioredis

from serve.auth import RouterGate, add_router_flags, router_gate
from serve.forwarder import ForwardError, NodeConnections
from serve.http_app import run_until_signal
from serve.http_limits import ServerLimits, add_limit_arguments, limits_from_args
from serve.http_routes import Request, Response, Routes
from serve.http_server import HttpServer
from serve.index_mirror import IndexMirror
from serve.locality_index import Holding, LocalityIndexReader
from serve.metrics import CONTENT_TYPE, FINE_LATENCY_BUCKETS_S, LATENCY_BUCKETS_S, Registry
from serve.node_pool import NodePool, NodeState, parse_addresses
from serve.policies import POLICY_NAMES, NodeView, RoutingPolicy, make_policy
from serve.protocol import DEFAULT_MAX_EVENTS, MAX_ID, RequestError, parse_events_request, parse_score_request

log = logging.getLogger("serve.router")
RETRY_ELSEWHERE = ("overloaded", "shutting_down")  # 503 codes of a node that another node may serve


class RouterMetrics:
    def __init__(self, registry: Registry, pool: NodePool) -> None:
        self.requests = registry.counter("hstu_router_requests_total", "Requests answered, by HTTP status.", ("code",))
        self.routed = registry.counter("hstu_router_routed_total", "Requests answered by each node.", ("node",))
        self.failovers = registry.counter(
            "hstu_router_failovers_total", "Forwards that failed and went to another node.", ("node",))
        self.index_errors = registry.counter("hstu_router_index_errors_total", "Locality index lookups that failed.")
        self.abandoned = registry.counter(
            "hstu_router_abandoned_total", "Forwards abandoned because the probe took their node out.", ("node",))
        self.latency = registry.histogram("hstu_router_request_seconds", "Time in the router, node included.",
                                          LATENCY_BUCKETS_S)
        self.overhead = registry.histogram("hstu_router_overhead_seconds", "Time in the router minus the node's answer.",
                                           FINE_LATENCY_BUCKETS_S)
        self.lookup = registry.histogram("hstu_router_index_lookup_seconds", "Locality index lookup time, by source.",
                                         FINE_LATENCY_BUCKETS_S, ("source",))
        registry.gauge_callback("hstu_router_node_up", "1 when the node is in the pool.",
                                lambda: {(n.address,): int(n.up) for n in pool.nodes}, ("node",))
        registry.gauge_callback("hstu_router_in_flight", "Requests forwarded and not yet answered.",
                                lambda: {(n.address,): n.in_flight for n in pool.nodes}, ("node",))


class Router:
    def __init__(self, pool: NodePool, policy: RoutingPolicy, redis_url: str | None = None,
                 forward_timeout_s: float = 30.0, probe_interval_s: float = 0.5,
                 request_deadline_s: float | None = None, max_events: int = DEFAULT_MAX_EVENTS,
                 gate: RouterGate | None = None) -> None:
        if policy.uses_index and redis_url is None:
            raise ValueError(f"policy {policy.name} reads the locality index: give --redis_url")
        self.pool = pool
        self.policy = policy
        self.redis_url = redis_url
        self.forward_timeout_s = forward_timeout_s
        self.max_events = max_events
        # every attempt of one request together, failovers included (default: one forward's timeout)
        self.request_deadline_s = forward_timeout_s if request_deadline_s is None else request_deadline_s
        self.gate = gate or RouterGate(None, None, None)  # serve/auth.py: open unless configured
        self._connections = {n.address: NodeConnections(*_host_port(n.address), self.gate.node_authorization)
                             for n in pool.nodes}
        self.probe_interval_s = probe_interval_s
        self.registry = Registry()
        self.metrics = RouterMetrics(self.registry, pool)
        # read from the mirror, which counts them itself (a gauge of a count that only grows)
        self.registry.gauge_callback(
            "hstu_router_index_malformed_messages", "Locality index change messages no node could have written.",
            lambda: self._mirror.malformed_messages if self._mirror is not None else 0)
        self._session: aiohttp.ClientSession | None = None
        self._redis: aioredis.Redis | None = None
        self._index: LocalityIndexReader | None = None
        self._mirror: IndexMirror | None = None
        self._tasks: list[asyncio.Task] = []

    def routes(self) -> Routes:
        routes = Routes()
        routes.add("POST", "/score", self.gate.guard("score", self.score))
        routes.add("POST", "/events", self.gate.guard("events", self.events))
        routes.add("GET", "/health", self.health)
        routes.add("GET", "/metrics", self.metrics_text)
        routes.add_prefix("GET", "/route/", self.gate.guard("score", self.route))
        return routes

    # ------------------------------------------------------------------ handlers
    async def score(self, request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            query = parse_score_request(request.body, max_events=self.max_events)
        except RequestError as err:
            return self._answer_error(err)
        refusal = self.gate.admit_events(len(query.events) if query.events is not None else 0)
        if refusal is not None:
            return refusal
        return await self._forward("/score", request.body, query.user_id, arrived)

    async def events(self, request: Request) -> Response:
        """To the node the first event's user would be scored on: any node appends to the shared store,
        and a retry on another node after a failed forward stores nothing twice. An empty batch with a
        batch_id goes to a node too: only the store knows whether that id was used for other events."""
        arrived = time.perf_counter()
        try:
            events, batch_id = parse_events_request(request.body, self.max_events)
        except RequestError as err:
            return self._answer_error(err)
        refusal = self.gate.admit_events(len(events))
        if refusal is not None:
            return refusal
        if not len(events) and batch_id is None:
            return Response.json({"appended": 0, "duplicates": 0, "late": 0, "replayed": False})
        user_id = int(events.user_id[0]) if len(events) else zlib.crc32(batch_id.encode())
        return await self._forward("/events", request.body, user_id, arrived)

    async def _forward(self, path: str, body: bytes, user_id: int, arrived: float) -> Response:
        """Forward to the node the policy picks for `user_id`; on a failed or refused forward, to the next."""
        tried: set[str] = set()
        overloaded: tuple[NodeState, int, bytes] | None = None  # the last node that said so
        while True:
            live = [n for n in self.pool.live() if n.node_id not in tried]
            if not live and overloaded is not None:
                # Every node that answered is busy: pass "overloaded" on, so the client backs off and
                # retries, rather than "no node available", which reads as an outage.
                node, status, payload = overloaded
                self.metrics.requests.inc(code=str(status))
                return Response(status, payload, headers=(("X-Routed-To", node.node_id),))
            if not live:
                reason = "no node is up" if not tried else f"every node failed ({', '.join(sorted(tried))})"
                return self._answer_error(RequestError(503, "no_node_available", reason))
            remaining = self.request_deadline_s - (time.perf_counter() - arrived)
            if remaining <= 0:
                message = f"no node answered within {self.request_deadline_s:g} s (tried {', '.join(sorted(tried))})"
                return self._answer_error(RequestError(504, "deadline_exceeded", message))
            node, _ = await self._choose(user_id, live)
            tried.add(node.node_id)  # never the same node twice for one visit: it may have scored it
            sent = time.perf_counter()
            try:
                async with self.pool.forwarding(node) as forward:
                    status, payload = await self._connections[node.address].post(
                        path, body, min(self.forward_timeout_s, remaining))
            except ForwardError as err:
                self.pool.mark_down(node, f"forward failed: {err}")
                self._connections[node.address].close()
                self.metrics.failovers.inc(node=node.address)
                continue
            if forward.abandoned:
                self.metrics.abandoned.inc(node=node.address)
                self.metrics.failovers.inc(node=node.address)
                continue
            upstream = time.perf_counter() - sent
            code = _error_code(payload) if status == 503 else ""
            if code in RETRY_ELSEWHERE:
                if code == "shutting_down":
                    self.pool.mark_down(node, "shutting down", abandon=False)
                else:
                    overloaded = (node, status, payload)
                self.metrics.failovers.inc(node=node.address)
                continue
            total = time.perf_counter() - arrived
            self.metrics.requests.inc(code=str(status))
            self.metrics.routed.inc(node=node.address)
            self.metrics.latency.observe(total)
            self.metrics.overhead.observe(max(0.0, total - upstream))
            return Response(status, payload, headers=(("X-Routed-To", node.node_id),))

    async def health(self, request: Request) -> Response:
        up = bool(self.pool.live())
        body = {"status": "ok" if up else "unavailable", "policy": self.policy.name,
                "model_fingerprint": self.pool.fingerprint, "nodes": self.pool.describe()}
        return Response.json(body, status=200 if up else 503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(200, self.registry.render().encode(), content_type=CONTENT_TYPE)

    async def route(self, request: Request) -> Response:
        text = request.path_tail
        # str.isdigit alone accepts "²", which int() refuses
        if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= MAX_ID):
            return self._answer_error(
                RequestError(400, "invalid_field", f"user_id must be an integer in [0, 2**63), got {text[:40]!r}"),
                count=False)
        live = self.pool.live()
        if not live:
            return Response.json({"node": None, "nodes": {}}, status=503)
        chosen, holdings = await self._choose(int(text), live)
        nodes = {n.node_id: {"in_flight": n.in_flight, "holding": holdings[n.node_id]._asdict()
                             if n.node_id in holdings else None} for n in live}
        return Response.json({"policy": self.policy.name, "node": chosen.node_id, "nodes": nodes,
                              "index_mirror_synced": self._mirror is not None and self._mirror.synced})

    # ------------------------------------------------------------------ routing
    async def _choose(self, user_id: int, live: list[NodeState]) -> tuple[NodeState, dict[str, Holding]]:
        """-> (the node the policy picks among `live`, what the index says each of them holds)."""
        holdings = await self._lookup(user_id, live) if self.policy.uses_index else {}
        views = [NodeView(n.node_id, n.in_flight, holdings.get(n.node_id)) for n in live]
        return self.pool.by_id(self.policy.choose(user_id, views)), holdings

    async def _lookup(self, user_id: int, live: list[NodeState]) -> dict[str, Holding]:
        """What the index says each live node holds of the user: from the mirror when it is in sync,
        else from Redis ({} when that fails too)."""
        if self._index is None and self.pool.fingerprint:
            self._open_index(self.pool.fingerprint)
        if self._index is None:
            return {}
        started = time.perf_counter()
        node_ids = [n.node_id for n in live]
        if self._mirror.synced:
            holdings = self._mirror.holdings(user_id, node_ids)
            self.metrics.lookup.observe(time.perf_counter() - started, source="mirror")
            return holdings
        try:
            return await self._index.lookup(user_id, node_ids)
        except (aioredis.RedisError, OSError, asyncio.TimeoutError) as err:
            self.metrics.index_errors.inc()
            log.debug("locality index lookup failed: %s", err)
            return {}
        finally:
            self.metrics.lookup.observe(time.perf_counter() - started, source="redis")

    def _open_index(self, namespace: str) -> None:
        """Start reading the index of `namespace` (the nodes' model fingerprint, learnt from their /health)."""
        self._index = LocalityIndexReader(self._redis, namespace)
        self._mirror = IndexMirror(self._redis, namespace, check_interval_s=self.probe_interval_s)
        self._tasks.append(asyncio.get_running_loop().create_task(self._mirror.run(), name="index-mirror"))

    def _answer_error(self, err: RequestError, count: bool = True) -> Response:
        if count:
            self.metrics.requests.inc(code=str(err.status))
        return Response.json(err.to_json(), status=err.status)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Open the probe session and Redis, learn which nodes are up, start the background tasks."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        if self.redis_url is not None:
            self._redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=0.25, socket_connect_timeout=0.25)
        await self.pool.probe_all(self._session)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.pool.probe_forever(self._session, self.probe_interval_s), name="probes"))
        if self.policy.uses_index and self.pool.fingerprint:
            self._open_index(self.pool.fingerprint)

    async def stop(self) -> None:
        """Undo `start` (also a partial one)."""
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
        for connections in self._connections.values():
            connections.close()
        if self._redis is not None:
            await self._redis.aclose()


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _error_code(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return ""


async def run(router: Router, host: str, port: int, shutdown_timeout_s: float = 10.0,
              limits: ServerLimits | None = None) -> None:
    server = HttpServer(router.routes(), limits)

    async def start() -> None:
        await router.start()
        await server.start(host, port)

    async def stop() -> None:
        await server.stop(shutdown_timeout_s)
        await router.stop()

    await run_until_signal(start, stop, on_ready=lambda: log.info(
        "router (%s) ready on http://%s:%d over %d nodes", router.policy.name, host, port, len(router.pool.nodes)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", required=True, help="comma-separated HOST:PORT of the nodes")
    p.add_argument("--policy", default="kv-aware", choices=POLICY_NAMES)
    p.add_argument("--redis_url", default=None, help="the Redis of the locality index (kv-aware)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--load_slack", type=int, default=0,
                   help="kv-aware: a node may have this many more requests in flight than the least busy and still "
                        "be chosen for its cache")
    p.add_argument("--queue_cost_tokens", type=float, default=64.0,
                   help="kv-aware: cached tokens one request in an eligible node's queue outweighs")
    p.add_argument("--forward_timeout_s", type=float, default=30.0)
    p.add_argument("--request_deadline_s", type=float, default=None,
                   help="a request's every attempt together, failovers included (default: --forward_timeout_s)")
    add_limit_arguments(p)
    p.add_argument("--probe_interval_s", type=float, default=0.5)
    p.add_argument("--probe_timeout_s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=None, help="random policy seed")
    add_router_flags(p)
    p.add_argument("--log_level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("serve").setLevel(args.log_level)
    try:
        pool = NodePool(parse_addresses(args.nodes), probe_timeout_s=args.probe_timeout_s)
        policy = make_policy(args.policy, seed=args.seed, queue_cost_tokens=args.queue_cost_tokens,
                             load_slack=args.load_slack)
        router = Router(pool, policy, args.redis_url, args.forward_timeout_s, args.probe_interval_s,
                        args.request_deadline_s, gate=router_gate(args, DEFAULT_MAX_EVENTS))
        limits = limits_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    asyncio.run(run(router, args.host, args.port, limits=limits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
