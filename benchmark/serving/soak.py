"""A bounded soak: a steady request rate across 2 nodes and 2 routers, with a node, a router and
Redis each killed once (SIGKILL) and restarted. Not run in CI (30 minutes by default).

    python -m benchmark.serving.soak --output artifacts/soak/soak.json                 # 1800 s, tiny artifacts
    python -m benchmark.serving.soak --data_dir DIR --checkpoint DIR --duration_s 900 --rate 4

The processes are real (benchmark/harness/launch.py: nodes, routers; a redis-server on a fixed port, so that it
can come back where the nodes and routers look for it). Without --data_dir/--checkpoint the
tests' tiny dataset and checkpoint are built in the workdir (tests/helpers.py), whose model makes
every token count. Requests are the dataset's visits, cycled, sent at `--rate` per second (evenly
spaced: a steady rate, not bursts) by `ScoreClient`, which retries on the other router; scoring is
idempotent, so a visit replayed gives the offline replay's logits every time.

Kills at fractions of the duration (`--kill_node_at`, `--kill_router_at`, `--kill_redis_at`), each
process restarted `--down_s` later. Reported (JSON, and a PNG beside it): lost requests (the client
gave up), refusals, wrong logits (against `InferenceSession` offline), p50/p99 per `--window_s`,
RSS over time of every process (per incarnation; growth after `--warmup_s` per process that lived
through the end, as is and net of the caches it holds by design: a node's host tier, `host_bytes_used`,
and Redis's data, `used_memory`, both bounded by their capacities), and each node's pages in use and
pages owned by its users at the end after the load stopped.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis as redis_client

from benchmark.cli import add_output
from benchmark.harness.launch import REPO_ROOT, Service, free_port, start_node, start_routers, wait_healthy, wait_until
from benchmark.harness.visits import query_body, visit_queries
from benchmark.report import write_json
from benchmark.serving.soak_report import latency_windows, plot, rss_growth
from serve.client import ScoreClient
from serve.metrics import parse_samples

sys.path.append(str(REPO_ROOT / "tests"))  # the tests' tiny dataset and checkpoint (helpers.py)

NODE_ARGS = ["--kv_pages", "512", "--max_wait_ms", "1", "--heartbeat_s", "0.5", "--index_ttl_s", "2.0",
             "--max_candidates", "64"]
ROUTER_ARGS = ["--probe_interval_s", "0.5", "--forward_timeout_s", "20"]


class RedisProcess:
    """redis-server on a port that stays the same across restarts (the cluster's --redis_url)."""

    def __init__(self, workdir: Path) -> None:
        from kvcache.local_redis import redis_server_binary
        self.binary, self.workdir, self.port = redis_server_binary() or "redis-server", workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.name = "redis"
        self.start()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)], stdout=subprocess.DEVNULL)
        ping = redis_client.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        if not wait_until(lambda: _pings(ping), 10.0):
            raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _pings(client) -> bool:
    try:
        return bool(client.ping())
    except redis_client.RedisError:
        return False


def artifacts(args) -> tuple[Path, Path]:
    if args.data_dir and args.checkpoint:
        return Path(args.data_dir), Path(args.checkpoint)
    from data.dataset import InferenceDataset
    from helpers import build_processed, sensitive_model
    from model.checkpoint import save_checkpoint
    from model.config import config_for_dataset
    root = Path(args.workdir) / "tiny"
    if not (root / "checkpoint").exists():  # the serving tests' artifacts (tests/serve/conftest.py)
        processed = build_processed(root)
        save_checkpoint(sensitive_model(config_for_dataset("tiny", InferenceDataset(processed)), seed=0),
                        root / "checkpoint")
    return root / "processed", root / "checkpoint"


class Soak:
    def __init__(self, args, data_dir: Path, checkpoint: Path) -> None:
        workdir = Path(args.workdir)
        self.args, self.start = args, time.monotonic()
        self.redis = RedisProcess(workdir / "redis")
        self.nodes: list = [start_node(data_dir, checkpoint, workdir / "logs", self.redis.url, extra_args=NODE_ARGS)
                            for _ in range(2)]
        self.routers: list = start_routers(2, [n.address for n in self.nodes], "kv-aware", workdir / "logs",
                                           self.redis.url, extra_args=ROUTER_ARGS)
        wait_healthy([*self.nodes, *self.routers], timeout_s=240)
        self.events: list[dict] = []
        self.rss: dict[str, list] = {}  # name -> [(t, pid, RSS MB, cache MB)]
        self.lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.start

    def processes(self) -> dict[str, object]:
        return {"redis": self.redis.proc, **{f"node{i}": n.proc for i, n in enumerate(self.nodes)},
                **{f"router{i}": r.proc for i, r in enumerate(self.routers)}}

    def sample_rss(self) -> None:
        for name, proc in self.processes().items():
            try:
                text = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue  # between a kill and its restart
            mb = next(int(line.split()[1]) / 1024 for line in text.splitlines() if line.startswith("VmRSS:"))
            self.rss.setdefault(name, []).append((self.now(), proc.pid, mb, self._cache_mb(name)))

    def _cache_mb(self, name: str) -> float:
        """What the process holds as cache, bounded by its capacity setting (0: unknown, or none)."""
        try:
            if name == "redis":
                client = redis_client.Redis(port=self.redis.port, socket_timeout=1, socket_connect_timeout=1)
                return client.info("memory")["used_memory"] / 2**20
            if name.startswith("node"):
                url = self.nodes[int(name[4:])].url
                with urllib.request.urlopen(f"{url}/metrics", timeout=1) as resp:
                    samples = parse_samples(resp.read().decode())
                return samples.get('hstu_kvcache{stat="host_bytes_used"}', 0.0) / 2**20
        except (OSError, redis_client.RedisError):
            pass
        return 0.0

    def kill_and_restart(self, what: str) -> None:
        """SIGKILL, `--down_s` down, then the same command again (same port); logged as events."""
        group = {"node": self.nodes, "router": self.routers}.get(what)
        self.events.append({"t": self.now(), "event": f"kill {what}"})
        if group is None:
            self.redis.kill()
            time.sleep(self.args.down_s)
            self.redis.start()
        else:
            group[0].kill()
            time.sleep(self.args.down_s)
            group[0] = group[0].restart()
            wait_healthy([group[0]], timeout_s=240)
        self.events.append({"t": self.now(), "event": f"{what} back"})


def run_load(soak: Soak, queries: list, expected: dict, args) -> list[dict]:
    client = ScoreClient([r.url for r in soak.routers], timeout_s=20.0, deadline_s=60.0)
    results: list[dict] = []

    def one(query, sent: float) -> None:
        start = time.monotonic()
        row = {"t": sent, "request_id": query.request_id}
        try:
            answer = client.score(json.loads(query_body(query)))
            want = expected[int(query.request_id)]
            got = np.asarray(answer.body["logits"], dtype=np.float64)
            row.update(ok=True, attempts=answer.attempts, diff=float(np.abs(got - want).max()),
                       scale=max(1.0, float(np.abs(want).max())), tier=answer.body["cache"]["tier"])
        except Exception as err:  # every failure is a finding to count, not to stop on
            row.update(ok=False, error=f"{type(err).__name__}: {err}"[:300])
        row["latency_s"] = time.monotonic() - start
        with soak.lock:
            results.append(row)

    kills = sorted((frac * args.duration_s, what) for what, frac in
                   (("node", args.kill_node_at), ("router", args.kill_router_at), ("redis", args.kill_redis_at)))
    killers, stop = [], threading.Event()

    def sample() -> None:  # its own thread: reading a busy node's /metrics must not delay the requests
        while not stop.wait(args.sample_s):
            soak.sample_rss()

    sampler = threading.Thread(target=sample, name="rss-sampler")
    sampler.start()
    with ThreadPoolExecutor(args.max_in_flight) as pool:
        for k, query in enumerate(itertools.cycle(queries)):
            due = k / args.rate
            if due >= args.duration_s:
                break
            while True:  # kills are checked even when the requests run behind their schedule
                now = soak.now()
                if kills and now >= kills[0][0]:
                    killers.append(threading.Thread(target=soak.kill_and_restart, args=(kills.pop(0)[1],)))
                    killers[-1].start()
                if now >= due:
                    break
                time.sleep(min(0.005, due - now))
            pool.submit(one, query, due)
    for thread in killers:
        thread.join()
    stop.set()
    sampler.join()
    soak.sample_rss()
    return sorted(results, key=lambda r: r["t"])


def summarize(soak: Soak, results: list[dict], args) -> dict:
    ok = [r for r in results if r["ok"]]
    wrong = [r for r in ok if r["diff"] > 1e-5 * r["scale"]]
    windows = latency_windows(ok, args.duration_s, args.window_s)
    growth = rss_growth(soak.rss, args.warmup_s)
    time.sleep(2.0)  # the load stopped: let offloads and the index settle
    pages = {}
    for i, node in enumerate(soak.nodes):
        with urllib.request.urlopen(f"{node.url}/metrics", timeout=10) as resp:
            samples = parse_samples(resp.read().decode())
        pages[f"node{i}"] = {stat: samples.get(f'hstu_kvcache{{stat="{stat}"}}') for stat in
                             ("pages_in_use", "pages_owned", "pages_total", "users_on_device", "users_on_host")}
    latencies = [r["latency_s"] * 1000 for r in ok]
    return {
        "config": vars(args), "machine": "CPU", "requests": len(results), "answered": len(ok),
        "lost": len(results) - len(ok), "errors": sorted({r["error"] for r in results if not r["ok"]})[:20],
        "wrong_logits": len(wrong), "max_logit_diff": max((r["diff"] for r in ok), default=0.0),
        "retried": sum(r["attempts"] > 1 for r in ok),
        "tiers": {t: sum(r["tier"] == t for r in ok) for t in sorted({r["tier"] for r in ok})},
        "p50_ms": float(np.percentile(latencies, 50)) if ok else None,
        "p99_ms": float(np.percentile(latencies, 99)) if ok else None,
        "max_ms": max(latencies, default=None),
        "events": soak.events, "windows": windows, "rss_growth_after_warmup": growth, "pages_at_end": pages,
        "rss": {name: [[round(t, 1), pid, round(mb, 1), round(cache, 1)] for t, pid, mb, cache in s]
                for name, s in soak.rss.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", help="preprocessor_inference.py output (default: the tests' tiny dataset)")
    p.add_argument("--checkpoint", help="model.train output (default: the tests' tiny model)")
    p.add_argument("--workdir", default="artifacts/soak")
    p.add_argument("--duration_s", type=float, default=1800.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--visits", type=int, default=400, help="distinct visits, cycled")
    p.add_argument("--kill_node_at", type=float, default=0.25, help="fraction of the duration")
    p.add_argument("--kill_router_at", type=float, default=0.5)
    p.add_argument("--kill_redis_at", type=float, default=0.75)
    p.add_argument("--down_s", type=float, default=5.0)
    p.add_argument("--warmup_s", type=float, default=120.0)
    p.add_argument("--window_s", type=float, default=30.0)
    p.add_argument("--sample_s", type=float, default=5.0)
    p.add_argument("--max_in_flight", type=int, default=64)
    add_output(p, "artifacts/soak/soak.json", help="JSON summary; the PNG goes beside it")
    args = p.parse_args(argv)

    from data.dataset import InferenceDataset
    from helpers import offline_logits
    from model.checkpoint import load_checkpoint
    data_dir, checkpoint = artifacts(args)
    dataset = InferenceDataset(data_dir)
    indices = dataset.request_indices(max_requests=args.visits)
    expected = {i: t.double().numpy() for i, t in
                offline_logits(load_checkpoint(checkpoint).model, dataset, indices).items()}
    soak = Soak(args, data_dir, checkpoint)
    services: list[Service] = []
    try:
        results = run_load(soak, visit_queries(dataset, indices), expected, args)
        summary = summarize(soak, results, args)
    finally:
        services = [*soak.routers, *soak.nodes]
        for service in services:
            service.stop(timeout_s=30)
        soak.redis.kill()
    out = Path(args.output)
    write_json(out, summary, indent=1)
    plot(summary, out.with_suffix(".png"))
    write_json(None, {k: summary[k] for k in ("requests", "answered", "lost", "wrong_logits", "max_logit_diff",
                                              "retried", "tiers", "p50_ms", "p99_ms", "max_ms", "events",
                                              "rss_growth_after_warmup", "pages_at_end")}, echo=True, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
