"""The router front's overhead, A/B in one run: the hand-written HTTP/1.1 parser against llhttp.

    python benchmark/router_front_ab.py --rounds 3000          # --old_rev: the last commit with the old front

Three processes on loopback: a fake node (answers /score with a fixed ~1.5 KB body at once, so
that only HTTP and the router's code are measured) and two routers in front of it, one on each
front, both running this tree's `serve.router.Router`. The old front is `serve/http_server.py` as of
`--old_rev`, read from git. The client sends the same request straight to the node, through the old
front and through the new one, in a shuffled order each round, over one keep-alive connection each,
and reports each path's p50 / p99, the p50 each router adds, and the median of paired differences
(the same round's direct and routed request, back to back).
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from serve.http_routes import Request, Response, Routes  # noqa: E402
from serve.http_server import HttpServer  # noqa: E402
from serve.launch import free_port, wait_until  # noqa: E402

OLD_REV = "dcb203b"  # the last commit whose router front is the hand-written parser
SCORE_BODY = json.dumps({"user_id": 52, "request_time_ms": 1650598436000,
                         "candidate_video_ids": list(range(3120, 3136)), "request_id": "r-1"}).encode()
ANSWER = json.dumps({"user_id": 52, "node": "fake", "logits": [[-0.612345] * 8] * 16,
                     "cache": {"tier": "device", "tokens_reused": 409}}).encode()


# ---------------------------------------------------------------------- the processes
async def _fake_node(port: int) -> None:
    async def score(request: Request) -> Response:
        return Response(200, ANSWER)

    async def health(request: Request) -> Response:
        return Response.json({"node_id": "fake", "model_fingerprint": "ab"})

    routes = Routes()
    routes.add("POST", "/score", score)
    routes.add("GET", "/health", health)
    server = HttpServer(routes)
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


def _old_front(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:serve/http_server.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_http_server.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_http_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def _router(port: int, node_port: int, front: str, old_rev: str) -> None:
    from serve.node_pool import NodePool
    from serve.policies import make_policy
    from serve.router import Router

    router = Router(NodePool([f"127.0.0.1:{node_port}"]), make_policy("round-robin"))
    await router.start()
    if front == "old":  # the old server only needs `routes.resolve` and the handlers' Response fields
        server = _old_front(old_rev).HttpServer(router.routes(), max_body_bytes=1 << 20)
    else:
        server = HttpServer(router.routes())
    await server.start("127.0.0.1", port)
    await asyncio.Event().wait()


# ---------------------------------------------------------------------- the client
def _post(conn: http.client.HTTPConnection) -> float:
    started = time.perf_counter()
    conn.request("POST", "/score", SCORE_BODY, {"Content-Type": "application/json"})
    response = conn.getresponse()
    body = response.read()
    elapsed = time.perf_counter() - started
    if response.status != 200 or body != ANSWER:
        raise RuntimeError(f"unexpected answer {response.status}: {body[:100]!r}")
    return elapsed


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def _ms(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000.0


def measure(rounds: int, warmup: int, old_rev: str, seed: int) -> dict:
    node_port, old_port, new_port = free_port(), free_port(), free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    procs = [subprocess.Popen([*me, "--role", "node", "--port", str(node_port)])]
    for front, port in (("old", old_port), ("new", new_port)):
        procs.append(subprocess.Popen([*me, "--role", front, "--port", str(port), "--node_port", str(node_port),
                                       "--old_rev", old_rev]))
    try:
        for port in (node_port, old_port, new_port):
            if not wait_until(lambda port=port: _healthy(port), 30):
                raise RuntimeError(f"nothing healthy on port {port}")
        conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                 for name, port in (("direct", node_port), ("old", old_port), ("new", new_port))}
        times: dict[str, list[float]] = {name: [] for name in conns}
        rng = random.Random(seed)
        for i in range(warmup + rounds):
            order = list(conns)
            rng.shuffle(order)
            sample = {name: _post(conns[name]) for name in order}
            if i >= warmup:
                for name, value in sample.items():
                    times[name].append(value)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    direct = times["direct"]
    report = {"rounds": rounds, "old_rev": old_rev,
              "direct_ms": {"p50": _ms(direct, 0.5), "p99": _ms(direct, 0.99)}}
    for front in ("old", "new"):
        routed = times[front]
        report[front] = {"p50_ms": _ms(routed, 0.5), "p99_ms": _ms(routed, 0.99),
                         "p50_added_ms": _ms(routed, 0.5) - _ms(direct, 0.5),
                         "paired_median_added_ms": statistics.median(r - d for r, d in zip(routed, direct)) * 1000.0}
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--old_rev", default=OLD_REV)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--role", choices=("client", "node", "old", "new"), default="client", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--node_port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "node":
        asyncio.run(_fake_node(args.port))
    elif args.role in ("old", "new"):
        asyncio.run(_router(args.port, args.node_port, args.role, args.old_rev))
    else:
        print(json.dumps(measure(args.rounds, args.warmup, args.old_rev, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
