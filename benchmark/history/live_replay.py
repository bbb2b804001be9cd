"""Live replay: the later period of a dataset sent as live traffic through a router, checked against the
offline replay of the same visits.

    python -m benchmark.history.live_replay --data_dir artifacts/synthetic/processed \\
        --checkpoint artifacts/synthetic/checkpoint [--store sqlite:///tmp/h.sqlite | redis://...] \\
        [--nodes 2 --clients 4 --max_requests 300 --output live.json]

1. A history store gets the training period only (`--split_fraction` of the visits' period, or
   `--split_date`); `--nodes` nodes start over it, a router in front.
2. Ingestion alone: `--clients` threads post synthetic events (users and videos no visit reads)
   to one node for `--ingest_seconds`: events/s into that node's store.
3. Live: the later period's events and visits in time order (benchmark/harness/live_traffic.py), `--clients`
   at a time. The events of the next step are posted while this step's visits are scored (a visit
   reads only events before its time, so the overlap changes nothing it sees).
4. Quiet: caches reset, the same visits scored again with no ingestion at all.

Reports, in one run: max |logit diff| of both passes against the offline replay (full recompute
over the whole dataset), the click AUCs (live, quiet, offline: equal), events/s ingested per node,
score latency p50/p99 with and without ingestion and their ratio, and store read round trips per
visit. Results on stdout and in `--output` (JSON).
"""
from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmark.cli import add_checkpoint, add_data_dir, add_output
from benchmark.harness.launch import start_node, start_router, wait_healthy
from benchmark.harness.live_traffic import live_steps
from benchmark.harness.visits import visit_queries
from benchmark.report import write_json
from data import schema
from data.dataset import InferenceDataset
from history.bootstrap import bootstrap_from_output
from history.registry import open_history_store
from model.checkpoint import load_checkpoint
from model.inference import InferenceSession
from model.metrics import auc
from serve.client import ScoreClient
from serve.metrics import parse_samples

SYNTHETIC_ID_BASE = 1 << 40  # users and videos of the ingestion phase: far from any visit's ids


def offline_scores(model, dataset: InferenceDataset, indices: np.ndarray) -> dict[int, np.ndarray]:
    """Full recompute of each visit over the whole dataset: what every served answer must equal."""
    session, out = InferenceSession(model, dataset), {}
    for batch in tqdm(list(dataset.batches(indices, 8)), desc="offline replay", unit="batch"):
        result = session.serve(batch)
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        out.update({int(r): result.logits[offsets[b]:offsets[b + 1]].numpy() for b, r in enumerate(batch.tolist())})
    return out


def synthetic_bodies(clients: int, count: int, batch: int, time_ms: int) -> list[list[bytes]]:
    """Per client, `count` POST /events bodies of `batch` distinct events (users and videos no visit reads),
    serialised before the clock starts: the client's JSON work is not the node's."""
    rng = np.random.default_rng(0)
    out = []
    for c in range(clients):
        bodies = []
        for k in range(count):
            users = SYNTHETIC_ID_BASE + rng.integers(0, 10_000, batch)
            videos = SYNTHETIC_ID_BASE + rng.integers(0, 100_000, batch)
            first = ((c * count + k) * batch)
            events = [{"user_id": int(u), "video_id": int(v), "time_ms": time_ms + first + i, "is_click": int(i % 3 == 0)}
                      for i, (u, v) in enumerate(zip(users, videos))]
            bodies.append(json.dumps({"events": events}, separators=(",", ":")).encode())
        out.append(bodies)
    return out


def measure_ingestion(node_url: str, clients: int, seconds: float, batch: int, time_ms: int,
                      max_events_per_s: int = 60_000) -> dict:
    """`clients` threads posting `batch`-event requests to one node (keep-alive) for up to `seconds`:
    acknowledged events/s."""
    bodies = synthetic_bodies(clients, max(1, int(seconds * max_events_per_s / batch / clients)), batch, time_ms)
    host, port = node_url.removeprefix("http://").split(":")
    done, stop = [0] * clients, time.monotonic() + seconds

    def run(c: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        for body in bodies[c]:
            if time.monotonic() >= stop:
                break
            conn.request("POST", "/events", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = json.loads(response.read())
            if response.status != 200:
                raise RuntimeError(f"POST /events: {response.status} {answer}")
            done[c] += answer["appended"]
        conn.close()

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(run, range(clients)))
    elapsed = time.perf_counter() - started
    return {"events": sum(done), "seconds": round(elapsed, 3), "events_per_s": round(sum(done) / elapsed, 1),
            "clients": clients, "events_per_request": batch}


def score_pass(client: ScoreClient, dataset: InferenceDataset, steps, clients: int, post_events: bool,
               label: str) -> tuple[dict[int, np.ndarray], list[float]]:
    """Score every step's visits, `clients` at a time; with `post_events`, the next step's events are posted
    (in chunks, by another client thread) while this step is scored. -> (logits per request, latencies)."""
    logits, latencies = {}, []
    with ThreadPoolExecutor(clients) as pool, ThreadPoolExecutor(1) as ingest:
        def post(step) -> None:
            for lo in range(0, len(step.events), 500):
                client.events(step.events.take(slice(lo, lo + 500)).to_records())

        def score(query) -> None:
            started = time.perf_counter()
            answer = client.score({"user_id": query.user_id, "request_time_ms": query.request_time_ms,
                                   "candidate_video_ids": list(query.candidate_video_ids)})
            latencies.append(time.perf_counter() - started)
            logits[int(query.request_id)] = np.asarray(answer.body["logits"], dtype=np.float32)

        pending = ingest.submit(post, steps[0]) if post_events else None
        for k, step in enumerate(tqdm(steps, desc=label, unit="step")):
            if pending is not None:
                pending.result()  # this step's events are stored before its visits are scored
                pending = ingest.submit(post, steps[k + 1]) if k + 1 < len(steps) else None
            list(pool.map(score, visit_queries(dataset, step.requests)))
    return logits, latencies


def node_samples(urls: list[str]) -> list[dict[str, float]]:
    return [parse_samples(urllib.request.urlopen(f"{u}/metrics", timeout=30).read().decode()) for u in urls]


def click_auc_of(dataset: InferenceDataset, indices: np.ndarray) -> Callable[[dict[int, np.ndarray]], float | None]:
    """The click AUC of scores keyed by request index, against the labels of the requests `indices`."""
    labels = {int(r): dataset.make_batch(np.array([r]), np.array([0]), np.array([0])).labels for r in indices.tolist()}
    click = schema.TASKS.index("click")

    def click_auc(scores: dict[int, np.ndarray]) -> float | None:
        order = sorted(scores)
        return auc(np.concatenate([scores[r][:, click] for r in order]),
                   np.concatenate([labels[r][:, click] for r in order]))

    return click_auc


def score_latency_ms(with_ingestion: list[float], without: list[float]) -> dict:
    """p50 and p99 of /score (seconds in, ms out) with events streaming in and without."""
    p50_on, p99_on = (float(np.percentile(with_ingestion, q) * 1000) for q in (50, 99))
    p50_off, p99_off = (float(np.percentile(without, q) * 1000) for q in (50, 99))
    return {"with_ingestion": {"p50": round(p50_on, 2), "p99": round(p99_on, 2)},
            "without": {"p50": round(p50_off, 2), "p99": round(p99_off, 2)},
            "p50_ratio": round(p50_on / p50_off, 3)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p)
    add_checkpoint(p, required=True)
    p.add_argument("--store", default=None, help="history store URL (default: a SQLite file in a temporary directory)")
    p.add_argument("--split_fraction", type=float, default=0.5, help="the visits' period before this is bootstrap")
    p.add_argument("--split_date", type=int, default=None, help="YYYYMMDD (Beijing): overrides --split_fraction")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--clients", type=int, default=4, help="visits (distinct users) in flight at a time")
    p.add_argument("--max_requests", type=int, default=300)
    p.add_argument("--ingest_seconds", type=float, default=10.0)
    p.add_argument("--ingest_batch", type=int, default=500, help="events per POST /events in the ingestion phase")
    p.add_argument("--log_dir", default=None)
    add_output(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)

    dataset = InferenceDataset(args.data_dir)
    times = dataset.requests.time_ms
    split = (schema.beijing_midnight_ms(args.split_date) if args.split_date is not None
             else int(times[min(len(times) - 1, int(len(times) * args.split_fraction))]))
    tmp = Path(tempfile.mkdtemp(prefix="live_replay_"))
    store_url = args.store or f"sqlite://{tmp / 'history.sqlite'}"
    with open_history_store(store_url) as store:
        if store.num_events():
            p.error(f"{store.description} is not empty: the replay starts from the training period only")
        bootstrap_from_output(store, args.data_dir, until_ms=split)
    steps = list(live_steps(dataset, split, batch_size=args.clients, max_requests=args.max_requests))
    indices = np.concatenate([s.requests for s in steps])
    model = load_checkpoint(args.checkpoint).model
    expected = offline_scores(model, dataset, indices)

    log_dir = Path(args.log_dir or tmp / "logs")
    node_args = ["--admin", "--max_wait_ms", "1", "--kv_pages", "2048", "--max_events", str(max(500, args.ingest_batch))]
    nodes = [start_node(None, args.checkpoint, log_dir, extra_args=node_args, history_store=store_url)
             for _ in range(args.nodes)]
    router = start_router([n.address for n in nodes], "sticky-hash", log_dir)
    try:
        wait_healthy([*nodes, router], timeout_s=300)
        client = ScoreClient([router.url])
        ingestion = measure_ingestion(nodes[0].url, args.clients, args.ingest_seconds, args.ingest_batch,
                                      int(times.max()) + 1)
        reads_before = sum(s["hstu_history_read_round_trips"] for s in node_samples([n.url for n in nodes]))
        live, live_latency = score_pass(client, dataset, steps, args.clients, post_events=True, label="live")
        reads_after = sum(s["hstu_history_read_round_trips"] for s in node_samples([n.url for n in nodes]))
        for node in nodes:  # the quiet pass starts as cold as the live one
            urllib.request.urlopen(urllib.request.Request(f"{node.url}/admin/reset_cache", b"", method="POST"), timeout=60)
        quiet, quiet_latency = score_pass(client, dataset, steps, args.clients, post_events=False, label="quiet")
    finally:
        router.stop()
        for node in nodes:
            node.stop()

    click_auc = click_auc_of(dataset, indices)

    def max_diff(scores: dict[int, np.ndarray]) -> float:
        return float(max(np.abs(scores[r] - expected[r]).max() for r in expected))

    report = {
        "store": store_url.split("?")[0], "nodes": args.nodes, "clients": args.clients, "visits": len(indices),
        "events_streamed": int(sum(len(s.events) for s in steps)),
        "max_abs_logit_diff": {"live": max_diff(live), "quiet": max_diff(quiet)},
        "click_auc": {"live": click_auc(live), "quiet": click_auc(quiet), "offline": click_auc(expected)},
        "ingestion_one_node": ingestion,
        "score_latency_ms": score_latency_ms(live_latency, quiet_latency),
        "store_read_round_trips_per_visit": round((reads_after - reads_before) / len(indices), 2),
        "torch_threads": torch.get_num_threads(),
    }
    write_json(args.output, report, echo=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
