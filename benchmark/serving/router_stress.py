"""The router front under abuse, on loopback: slow large bodies (memory), and 20,000 half-open
connections (latency of everyone else).

    python -m benchmark.serving.router_stress --output artifacts/router_stress.json
    python -m benchmark.serving.router_stress --clients 3 --half_open 50 --stream_mib 1    # tiny mode (the test)

Processes: a real router (`python -m serve.router`, round-robin, so no Redis) in front of a fake
node of this script. The fake node stands in for real nodes on purpose: what is measured is the
router's memory and event loop, and a model node's 20-130 ms of CPU per visit, on the same 2
cores, would decide the latencies (and its own RSS nothing). It answers /score with a fixed body,
at once, or after `--slow_s` when the request's user is `SLOW_USER` (the streaming clients' user),
so that their requests stay in flight while they stream the next ones behind them, the case the
router's flow control exists for (issue 21: one client grew the router from 60 to 460 MB).

1. Memory: the router's RSS (/proc, sampled every 20 ms) idle after a warm-up, then while
   `--clients` clients each pipeline `--stream_mib` MiB of valid score requests of `--body_kib`
   (JSON padded with spaces; 1 MiB by default, the most the router accepts) at `--rate_kib_s` each.
   Reported: peak / idle.
2. Half-open connections: a latency client holds `--latency_connections` keep-alive connections
   opened first and sends `--latency_requests` requests over them, idle; then holder processes
   (each under its own file limit) open `--half_open` connections that send half a request head
   and go silent; the same requests again. Reported: p99 under the flood / idle p99, how many were
   held, how many the cap refused (503 and closed), and what a new connection gets meanwhile. The
   router's header and keep-alive timeouts are raised for this (`--header_timeout_s`, also so that
   the latency client's connections outlive the flood's setup), so the connections stay for
   the whole measurement: the worst case, an attacker who reconnects as fast as they expire.
   The soft file limit is raised to the hard one; the router's `--max_connections` is the flood
   plus the latency client's connections, lowered to what the router's file limit leaves room for.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmark.cli import add_output
from benchmark.harness.launch import REPO_ROOT, child_env, free_port, wait_until
from benchmark.report import write_json
from serve.http_routes import Request, Response, Routes
from serve.http_server import HttpServer

SLOW_USER = 1
FAST_BODY = json.dumps({"user_id": 52, "request_time_ms": 1650598436000, "candidate_video_ids": list(range(16))}).encode()
ANSWER = json.dumps({"user_id": 52, "node": "fake", "logits": [[-0.61] * 8] * 16}).encode()
FD_MARGIN = 256  # the router's own files: listening socket, node connections, Python's imports


def _fake_node(port: int, slow_s: float) -> None:
    async def score(request: Request) -> Response:
        if json.loads(request.body)["user_id"] == SLOW_USER:
            await asyncio.sleep(slow_s)
        return Response(200, ANSWER)

    async def health(request: Request) -> Response:
        return Response.json({"node_id": "fake", "model_fingerprint": "stress"})

    async def serve() -> None:
        routes = Routes()
        routes.add("POST", "/score", score)
        routes.add("GET", "/health", health)
        await HttpServer(routes).start("127.0.0.1", port)
        await asyncio.Event().wait()

    asyncio.run(serve())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RssSampler(threading.Thread):
    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s, self.peak, self._done = pid, interval_s, 0.0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(self.interval_s)

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.peak


# ---------------------------------------------------------------------- 1. slow large bodies
def padded_request(size: int) -> bytes:
    body = json.dumps({"user_id": SLOW_USER, "request_time_ms": 1, "candidate_video_ids": [1]}).encode()
    body += b" " * (size - len(body))
    return b"POST /score HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def _stream_client(port: int, total: int, size: int, rate_bps: float, chunk: int = 16 << 10) -> int:
    """Pipeline requests of `size` bytes, `total` bytes in all, at `rate_bps`; -> answers read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = 0

    async def read_answers() -> None:
        nonlocal answers
        while True:  # the answers must be read, or the router's writes would back up instead
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)
            answers += 1

    reading = asyncio.ensure_future(read_answers())
    data = padded_request(size) * max(1, total // size)
    start = time.perf_counter()
    for offset in range(0, len(data), chunk):
        writer.write(data[offset:offset + chunk])
        await writer.drain()  # blocks while the router has paused reading: the flow control at work
        await asyncio.sleep(max(0.0, (offset + chunk) / rate_bps - (time.perf_counter() - start)))
    reading.cancel()
    writer.close()
    return answers


def measure_streaming(port: int, pid: int, clients: int, stream_mib: int, body_kib: int, rate_kib_s: float) -> dict:
    sampler = RssSampler(pid)
    sampler.start()
    start = time.perf_counter()

    async def all_clients():
        return await asyncio.gather(*[_stream_client(port, stream_mib << 20, body_kib << 10, rate_kib_s * 1024)
                                      for _ in range(clients)])

    asyncio.run(all_clients())
    return {"peak_rss_mb": sampler.stop(), "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------------- 2. half-open connections
def _hold(port: int, count: int, pipe) -> None:
    """Open `count` connections that send half a head; report (held, refused); hold until told."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    socks, failed = [], 0
    for _ in range(count):
        s = socket.socket()
        try:
            s.settimeout(10)
            s.connect(("127.0.0.1", port))
            s.sendall(b"POST /score HTTP/1.1\r\nHost: r\r\nContent-")
            socks.append(s)
        except OSError:
            s.close()
            failed += 1
    time.sleep(0.5)  # a refusal is a 503 and a close: it arrives at once
    poller = select.poll()  # select() cannot take descriptors past 1024
    for s in socks:
        poller.register(s, select.POLLIN)
    readable = len(poller.poll(0))
    pipe.send((len(socks) - readable, readable, failed))
    pipe.recv()
    for s in socks:
        s.close()


def _latencies(conns: list[http.client.HTTPConnection], count: int) -> list[float]:
    out = []
    for i in range(count):
        conn = conns[i % len(conns)]
        start = time.perf_counter()
        conn.request("POST", "/score", FAST_BODY, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - start)
        if resp.status != 200:
            raise RuntimeError(f"the router answered {resp.status}")
    return out


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q))


def measure_half_open(port: int, pid: int, half_open: int, conns: int, requests: int, holders: int) -> dict:
    clients = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(conns)]
    _latencies(clients, 50)  # warm-up
    idle = _latencies(clients, requests)
    pipes, procs = [], []
    for share in np.array_split(np.arange(half_open), holders):
        ours, theirs = mp.Pipe()
        procs.append(mp.Process(target=_hold, args=(port, len(share), theirs), daemon=True))
        procs[-1].start()
        pipes.append(ours)
    counts = np.array([p.recv() for p in pipes]).sum(axis=0)
    flooded = _latencies(clients, requests)
    new_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # what a newcomer gets meanwhile
    try:
        new_conn.request("GET", "/health")
        newcomer = new_conn.getresponse().status
    except OSError as err:
        newcomer = f"{type(err).__name__}"
    for p in pipes:
        p.send("stop")
    for proc in procs:
        proc.join(30)
    return {"held": int(counts[0]), "refused_503": int(counts[1]), "connect_failed": int(counts[2]),
            "router_rss_mb_flooded": rss_mb(pid), "new_connection_status": newcomer,
            "idle_p50_ms": _p(idle, 50), "idle_p99_ms": _p(idle, 99),
            "flooded_p50_ms": _p(flooded, 50), "flooded_p99_ms": _p(flooded, 99)}


# ---------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--stream_mib", type=int, default=8, help="each streaming client's pipelined bytes")
    p.add_argument("--body_kib", type=int, default=1024, help="each pipelined request's body (the router's limit: 1024)")
    p.add_argument("--rate_kib_s", type=float, default=1024.0, help="each streaming client's send rate")
    p.add_argument("--slow_s", type=float, default=1.0, help="the fake node's time on a streaming client's request")
    p.add_argument("--half_open", type=int, default=20_000)
    p.add_argument("--holders", type=int, default=4, help="processes holding the half-open connections")
    p.add_argument("--latency_connections", type=int, default=4)
    p.add_argument("--latency_requests", type=int, default=2000)
    p.add_argument("--header_timeout_s", type=float, default=600.0)
    add_output(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the router inherits it
    wanted = args.half_open + args.latency_connections + 8
    max_connections = min(wanted, hard - FD_MARGIN)
    node_port, port = free_port(), free_port()
    node = mp.Process(target=_fake_node, args=(node_port, args.slow_s), daemon=True)
    node.start()
    router = subprocess.Popen(
        [sys.executable, "-m", "serve.router", "--nodes", f"127.0.0.1:{node_port}", "--policy", "round-robin",
         "--port", str(port), "--max_connections", str(max_connections), "--header_timeout_s",
         str(args.header_timeout_s), "--keep_alive_timeout_s", str(args.header_timeout_s), "--forward_timeout_s", "60",
         "--log_level", "WARNING"],
        cwd=REPO_ROOT, env=child_env())
    try:
        def healthy() -> bool:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/health")
                return conn.getresponse().status == 200
            except OSError:
                return False

        if not wait_until(healthy, 30.0, 0.1):
            raise RuntimeError("the router did not become healthy")
        warm = [http.client.HTTPConnection("127.0.0.1", port, timeout=30)]
        _latencies(warm, 200)  # every lazy import and buffer of a normal request in place
        time.sleep(0.5)
        idle_rss = rss_mb(router.pid)
        streaming = measure_streaming(port, router.pid, args.clients, args.stream_mib, args.body_kib,
                                       args.rate_kib_s)
        print(f"streaming: {streaming} (idle RSS {idle_rss:.1f} MB)", flush=True)
        half_open = measure_half_open(port, router.pid, args.half_open, args.latency_connections,
                                      args.latency_requests, args.holders)
    finally:
        router.terminate()
        router.wait(30)
        node.terminate()
    result = {
        "machine": f"CPU, {mp.cpu_count()} cores", "file_limit": hard, "max_connections": max_connections,
        "config": vars(args), "idle_rss_mb": idle_rss, "streaming": streaming, "half_open": half_open,
        "rss_ratio": streaming["peak_rss_mb"] / idle_rss,
        "p99_ratio": half_open["flooded_p99_ms"] / half_open["idle_p99_ms"],
    }
    print(f"router RSS idle {idle_rss:.1f} MB, peak while {args.clients} clients streamed "
          f"{args.stream_mib} MiB each: {streaming['peak_rss_mb']:.1f} MB -> {result['rss_ratio']:.2f}x (target < 2x)")
    print(f"{half_open['held']} half-open connections held, {half_open['refused_503']} refused (503), "
          f"{half_open['connect_failed']} connects failed; a new connection got {half_open['new_connection_status']}")
    print(f"p99 idle {half_open['idle_p99_ms']:.2f} ms, with them {half_open['flooded_p99_ms']:.2f} ms -> "
          f"{result['p99_ratio']:.2f}x (target < 10x); p50 {half_open['idle_p50_ms']:.2f} -> "
          f"{half_open['flooded_p50_ms']:.2f} ms")
    write_json(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
