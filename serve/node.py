"""A serving node: HTTP over a `ScoringEngine`, with dynamic batching, metrics and the locality index.

    python -m serve.node --history_store sqlite:///var/lib/hstu/history.sqlite --checkpoint DIR --port 8001 \
        [--redis_url redis://127.0.0.1:6379/0]
    python -m serve.node --data_dir DIR --checkpoint DIR --port 8001      # a fixed dataset, read-only

    POST /events   -> 200 {"appended", "duplicates", "late", "replayed"} once durable (serve/ingest.py)
                      | 400 / 409 / 413 {"error": ...} | 503 history_unavailable | 503 outcome_unknown
    POST /score    -> 200 scores | 400 / 422 {"error": {"code", "message"}} | 503 (queue full, shutting down)
                      (inline "events" are stored first, as by POST /events; every answer after that,
                      a refusal included, says what they stored: "events_stored")
    GET  /health   -> 200 {"status": "ok", "node_id", "model_fingerprint", "queue_depth", ...} | 503 draining
    GET  /metrics  -> Prometheus text
    POST /admin/reset_cache -> 200 (only with --admin): forget every user's K/V in every tier (benchmarks)

The HTTP front is the router's (serve/http_server.py), with the same limits and flags: header and body
deadlines (408), a connection cap (503), 1 MiB bodies (413). With `--redis_url` the node's K/V go
through to the shared Redis tier and its cache events to the locality index (serve/locality_index.py)
under the model fingerprint. SIGTERM / SIGINT: stop taking requests, serve the queued ones, offload
every user's device K/V to the host tiers (the shared one included), leave the index, exit 0.
docs/serving.md has the API with examples.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from serve import node_args
from serve.auth import node_guard
from serve.auth_tokens import NodeTokens
from serve.batcher import BatcherClosedError, DynamicBatcher, QueueFullError
from serve.http_app import run_until_signal
from serve.http_limits import ServerLimits, limits_from_args
from serve.http_server import HttpServer, Request, Response, Routes
from serve.ingest import Ingestor, append_result_json, with_events_stored
from serve.locality_index import TIERS
from serve.metrics import BATCH_SIZE_BUCKETS, CONTENT_TYPE, LATENCY_BUCKETS_S, Registry
from serve.protocol import DEFAULT_MAX_EVENTS, RequestError, ScoredVisit, ScoreQuery, parse_events_request, parse_score_request

log = logging.getLogger("serve.node")


class NodeMetrics:
    def __init__(self, registry: Registry) -> None:
        self.requests = registry.counter("hstu_node_requests_total", "Score requests answered, by HTTP status.", ("code",))
        self.latency = registry.histogram(
            "hstu_node_request_seconds", "Score request latency in the node (arrival to answer).", LATENCY_BUCKETS_S)
        self.queue_wait = registry.histogram(
            "hstu_node_queue_wait_seconds", "Time a request waited for its batch.", LATENCY_BUCKETS_S)
        self.batch_seconds = registry.histogram("hstu_node_batch_seconds", "Run time of a batch.", LATENCY_BUCKETS_S)
        self.batch_size = registry.histogram("hstu_node_batch_size", "Visits per batch.", BATCH_SIZE_BUCKETS)
        self.visits = registry.counter(
            "hstu_node_cache_visits_total", "Visits by the tier their reused K/V came from (none: nothing reused).", ("tier",))
        self.reused = registry.counter("hstu_node_tokens_reused_total", "History tokens read from the KV cache.", ("tier",))
        self.computed = registry.counter(
            "hstu_node_tokens_computed_total", "Tokens run through the model (history + candidates).")
        self.recomputed = registry.counter(
            "hstu_node_tokens_recomputed_total", "Computed history tokens that a tier visible to this node held.")
        self.shared_bytes = registry.counter(
            "hstu_node_shared_reload_bytes_total", "K/V bytes reloaded from the shared (Redis) tier.")
        for tier in TIERS:  # every series exists from the start
            self.visits.inc(0, tier=tier)
            self.reused.inc(0, tier=tier)

    def record(self, scored: ScoredVisit, seconds: float) -> None:
        cache = scored.cache
        self.requests.inc(code="200")
        self.latency.observe(seconds)
        self.queue_wait.observe(scored.queue_ms / 1000.0)
        self.visits.inc(tier=cache.tier)
        self.reused.inc(cache.tokens_reused, tier=cache.tier)
        self.computed.inc(cache.tokens_computed)
        self.recomputed.inc(cache.tokens_recomputed)
        self.shared_bytes.inc(cache.shared_reload_bytes)


class Node:
    """The HTTP layer: parse, check, queue, answer. The work is the engine's, on one compute thread."""

    def __init__(self, engine, node_id: str, max_batch_size: int, max_wait_s: float, max_queue: int, admin: bool = False,
                 max_events: int = DEFAULT_MAX_EVENTS, router_tokens: NodeTokens | None = None):
        self.engine = engine
        self.max_events = max_events
        self.router_tokens = router_tokens  # serve/auth.py: None answers anyone
        self.node_id = node_id
        self.admin = admin
        self.publisher = None
        self.draining = False
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.registry = Registry()
        self.metrics = NodeMetrics(self.registry)
        self.ingestor = Ingestor(engine.store, self.registry) if engine.store is not None else None
        if engine.store is not None:
            self.registry.gauge_callback(
                "hstu_history_read_round_trips", "Calls into the history store made to read visits' histories "
                "and counters (statements or server round trips).", lambda: engine.store.read_round_trips)
        self.batcher = DynamicBatcher(self._run_batch, key=lambda q: q.user_id, max_batch_size=max_batch_size,
                                      max_wait_s=max_wait_s, max_queue=max_queue, executor=self.executor)
        self.registry.gauge_callback(
            "hstu_node_queue_depth", "Requests queued or being scored.", lambda: self.batcher.queue_depth)
        self.registry.gauge_callback(
            "hstu_kvcache", "The node's KV cache counters and gauges (kvcache.CacheStats).",
            lambda: {(k,): v for k, v in engine.cache.stats().as_dict().items()}, ("stat",))

    def _run_batch(self, queries: list[ScoreQuery]):
        started = time.perf_counter()
        results = self.engine.score_batch(queries)
        self.metrics.batch_size.observe(len(queries))
        self.metrics.batch_seconds.observe(time.perf_counter() - started)
        return results

    def routes(self) -> Routes:
        routes = Routes()
        routes.add("POST", "/score", node_guard(self.router_tokens, self.score))
        routes.add("POST", "/events", node_guard(self.router_tokens, self.events))
        routes.add("GET", "/health", self.health)
        routes.add("GET", "/metrics", self.metrics_text)
        if self.admin:
            routes.add("POST", "/admin/reset_cache", self.reset_cache)
        return routes

    # ------------------------------------------------------------------ handlers
    async def score(self, request: Request) -> Response:
        arrived = time.perf_counter()
        stored = None  # what the inline events stored: every answer after the append says so
        try:
            if self.draining:
                raise RequestError(503, "shutting_down", f"node {self.node_id} is shutting down")
            max_time = self.ingestor.max_time_ms() if self.ingestor is not None else None
            query = parse_score_request(request.body, self.engine.config.max_candidates, max_time, self.max_events)
            self.engine.validate(query)
            if query.events is not None and len(query.events):
                stored = await self.ingestor.append(query.events)
            try:
                done = await self.batcher.submit(query)
            except QueueFullError as err:
                raise RequestError(503, "overloaded", f"node {self.node_id} is overloaded: {err}") from None
            except BatcherClosedError as err:
                raise RequestError(503, "shutting_down", f"node {self.node_id}: {err}") from None
        except RequestError as err:
            self.metrics.requests.inc(code=str(err.status))
            return Response.json(with_events_stored(err.to_json(), stored), err.status)
        except Exception as err:
            log.exception("scoring failed")
            self.metrics.requests.inc(code="500")
            refusal = {"error": {"code": "internal", "message": f"{type(err).__name__}: {err}"}}
            return Response.json(with_events_stored(refusal, stored), 500)
        result = done.result
        scored = ScoredVisit(query, self.node_id, result.logits, result.history_length, result.cache,
                             done.batch_size, done.queue_s * 1000.0, done.run_s * 1000.0)
        self.metrics.record(scored, time.perf_counter() - arrived)
        return Response(200, _dumps(with_events_stored(scored.to_json(), stored)).encode())

    async def events(self, request: Request) -> Response:
        try:
            if self.draining:
                raise RequestError(503, "shutting_down", f"node {self.node_id} is shutting down")
            if self.ingestor is None:
                raise RequestError(405, "read_only_history",
                                   f"node {self.node_id} serves a fixed dataset (no --history_store): it takes no events")
            events, batch_id = parse_events_request(request.body, self.max_events, self.ingestor.max_time_ms())
            result = await self.ingestor.append(events, batch_id)
        except RequestError as err:
            return Response.json(err.to_json(), err.status)
        except Exception as err:
            log.exception("ingestion failed")
            return Response.json({"error": {"code": "internal", "message": f"{type(err).__name__}: {err}"}}, 500)
        return Response.json(append_result_json(result))

    async def health(self, request: Request) -> Response:
        body = {
            "status": "draining" if self.draining else "ok",
            "node_id": self.node_id,
            "model_fingerprint": self.engine.fingerprint,
            "queue_depth": self.batcher.queue_depth,
            "max_batch_size": self.batcher.max_batch_size,
            "shared_tier": self.engine.config.redis_url is not None,
            "history": self.engine.store.description if self.engine.store is not None else "dataset (read-only)",
            "cuda_graphs": self.engine.session.graphs is not None,
            "warm_up": None if self.engine.warm_up_report is None else self.engine.warm_up_report.as_dict(),
        }
        return Response.json(body, 503 if self.draining else 200)

    async def metrics_text(self, request: Request) -> Response:
        return Response(200, self.registry.render().encode(), content_type=CONTENT_TYPE)

    async def reset_cache(self, request: Request) -> Response:
        """Between benchmark runs: on the compute thread, so no batch is in flight meanwhile."""
        await asyncio.get_running_loop().run_in_executor(self.executor, self.engine.reset_cache)
        return Response.json({"status": "ok"})

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.batcher.start()
        if self.publisher is not None:
            self.publisher.start()

    async def drain(self) -> None:
        """Take no new visits (503 shutting_down, /health 503), serve the queued ones."""
        self.draining = True
        await self.batcher.close(drain=True)

    async def stop(self) -> None:
        if self.ingestor is not None:
            self.ingestor.close()  # acknowledged appends are done: each answered only once durable
        await asyncio.get_running_loop().run_in_executor(self.executor, self.engine.shutdown)
        self.executor.shutdown(wait=True)
        if self.publisher is not None:
            self.publisher.stop(remove=True)
        log.info("node %s stopped: device K/V offloaded, left the locality index", self.node_id)


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


async def run(node: Node, host: str, port: int, limits: ServerLimits | None = None,
              shutdown_timeout_s: float = 30.0) -> None:
    """Serve until SIGTERM / SIGINT, then shut down gracefully: drain, then close the connections (the
    requests in hand get `shutdown_timeout_s`), then offload and leave the index."""
    server = HttpServer(node.routes(), limits)

    async def start() -> None:
        await node.start()
        await server.start(host, port)

    async def stop() -> None:
        try:
            await node.drain()
            await server.stop(shutdown_timeout_s)
        finally:
            await node.stop()

    await run_until_signal(start, stop, on_ready=lambda: log.info("node %s ready on http://%s:%d", node.node_id, host, port),
                           on_stop=lambda: log.info("node %s shutting down", node.node_id))


def build_parser() -> argparse.ArgumentParser:
    return node_args.build_parser(__doc__)


def index_publisher(args: argparse.Namespace, engine, node: Node):
    """The node's writer of the locality index, hearing the engine's cache events from now on."""
    import redis

    from serve.index_publisher import IndexPublisher
    from serve.locality_index import LocalityIndexWriter

    client = redis.Redis.from_url(args.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    writer = LocalityIndexWriter(client, engine.fingerprint, node.node_id, int(args.index_ttl_s * 1000))
    publisher = IndexPublisher(writer, args.heartbeat_s, lambda: {"queue_depth": node.batcher.queue_depth},
                               advertised_url=f"http://{args.host}:{args.port}")
    engine.locations.subscribe(publisher.listener)
    return publisher


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    node_args.check_args(parser, args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("serve").setLevel(args.log_level)
    import torch  # after parsing: --help answers without the heavy imports

    from history.base import HistoryUnavailableError
    from serve.engine import open_engine

    torch.set_num_threads(args.torch_threads)
    node_id = args.node_id or f"{args.host}:{args.port}"
    try:
        router_tokens = None if args.router_token_file is None else NodeTokens(args.router_token_file)
        engine = open_engine(node_args.engine_config(args))
    except (FileNotFoundError, ValueError, HistoryUnavailableError) as err:
        log.error("cannot start: %s", err)
        return 2
    warmed = engine.warm_up()  # before the server listens: /health answers only once every variant is compiled
    log.info("warmed %d attention variant(s) in %.1f s", len(warmed.variants), warmed.seconds)
    node = Node(engine, node_id, args.max_batch_size, args.max_wait_ms / 1000.0, args.max_queue, admin=args.admin,
                max_events=args.max_events, router_tokens=router_tokens)
    if args.redis_url is not None:
        node.publisher = index_publisher(args, engine, node)
    asyncio.run(run(node, args.host, args.port, limits_from_args(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
