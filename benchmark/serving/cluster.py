"""Serve the visit stream across N nodes behind a router, once per routing policy, and compare.

    python -m benchmark.serving.cluster --data_dir artifacts/synthetic/processed \\
        --checkpoint artifacts/synthetic/checkpoint --nodes 4 --rate 8 --output artifacts/cluster.json

Starts a private redis-server (the shared KV tier and the locality index), N `serve.node`
processes (one torch thread each) and, per policy, a `serve.router`, all on loopback. Per policy:
the nodes' caches and Redis are wiped, each replayed user's last visit before --from_date is
served (warm-up, not measured), then the visits from --from_date are replayed at --rate per second
(Poisson arrivals; a user's next visit waits for its previous answer). Reported per policy: where
each visit's K/V came from (the serving node's device or host memory, the shared tier, nowhere),
tokens and bytes reloaded from the shared tier, history tokens computed beyond what a perfect
cache computes (the offline replay's, from the same token layout), p50/p99 latency, throughput,
and the largest logit difference to the offline replay. After the kv-aware run the same requests
go straight to their node and through the router, interleaved: the router's overhead. A fault
run (kv-aware) kills one node half-way: every visit must still be answered, its users from the
shared tier elsewhere, with the offline replay's logits. Output: a table, JSON, a PNG.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmark.cli import add_checkpoint, add_data_dir, add_output, add_seed
from benchmark.harness.launch import Service, start_node, start_router, wait_healthy
from benchmark.harness.loadgen import Sent, latency_summary, replay
from benchmark.harness.visits import visit_queries
from benchmark.report import write_json
from benchmark.serving.cluster_report import plot, summarize, summarize_repeats, table
from benchmark.serving.replay_setup import working_set_pages
from benchmark.serving.router_overhead import overhead_probe, probe_queries
from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, beijing_midnight_ms
from kvcache.local_redis import LocalRedisServer, redis_server_binary
from model.cache_config import kv_cache_config, page_layout
from model.checkpoint import load_checkpoint, model_fingerprint
from model.inference import InferenceSession
from serve.locality_index import IndexKeys
from serve.policies import POLICY_NAMES
from serve.protocol import ScoreQuery

log = logging.getLogger("cluster_benchmark")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p)
    add_checkpoint(p, required=True)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated, run in this order")
    p.add_argument("--rate", type=float, default=6.0, help="offered visits per second")
    p.add_argument("--from_date", type=int, default=DEFAULT_SPLIT_DATE, help="YYYYMMDD: replay visits from this day")
    p.add_argument("--max_requests", type=int, default=300, help="visits replayed at --rate")
    p.add_argument("--saturation_requests", type=int, default=120,
                   help="the visits after those, sent closed-loop (16 in flight): throughput at saturation (0: skip)")
    p.add_argument("--max_batch_size", type=int, default=8)
    p.add_argument("--max_wait_ms", type=float, default=2.0)
    p.add_argument("--device_share", type=float, default=0.5,
                   help="each node's device pool holds this fraction of 1/N of the users' working set")
    p.add_argument("--host_share", type=float, default=1.5, help="... and its host-memory tier this fraction")
    p.add_argument("--repeats", type=int, default=1,
                   help="replays per policy, in alternating policy order; latencies pooled, token counts averaged")
    p.add_argument("--overhead_rounds", type=int, default=10, help="router overhead probe: rounds over 20 users")
    p.add_argument("--no_fault", action="store_true", help="skip the run that kills a node half-way")
    p.add_argument("--load_slack", type=int, default=0, help="kv-aware's --load_slack (serve/policies.py)")
    p.add_argument("--queue_cost_tokens", type=float, default=64.0, help="kv-aware's --queue_cost_tokens")
    add_seed(p)
    p.add_argument("--workdir", default=None, help="logs of the processes (default: a temporary directory)")
    add_output(p, "artifacts/cluster.json", help="JSON report; the PNG goes beside it")
    p.add_argument("--dump_visits", default=None, help="CSV of every measured visit (policy, node, tier, latency, ...)")
    p.add_argument("--quiet", action="store_true")
    return p


# ---------------------------------------------------------------- the offline reference
def warmup_indices(dataset: InferenceDataset, indices: np.ndarray, from_ms: int) -> np.ndarray:
    """Each replayed user's last visit before the replay window (time order)."""
    req = dataset.requests
    earlier = dataset.request_indices(until_time_ms=from_ms)
    earlier = earlier[np.isin(req.user_id[earlier], np.unique(req.user_id[indices]))]
    last = {int(u): int(i) for u, i in zip(req.user_id[earlier], earlier)}
    return np.sort(np.array(list(last.values()), dtype=np.int64))


def offline_reference(model, dataset: InferenceDataset, warm: np.ndarray, indices: np.ndarray, progress: bool):
    """-> ({request index: logits}, {request index: history tokens a perfect cache computes})."""
    from kvcache import KVCacheManager

    cache = KVCacheManager(kv_cache_config(model.config, num_pages=8192))
    session = InferenceSession(model, dataset, kv_cache=cache)
    logits = {}
    stream = np.concatenate([warm, indices])
    batches = list(dataset.batches(stream, 8))
    from tqdm import tqdm

    for batch in tqdm(batches, desc="offline replay", disable=not progress, file=sys.stderr, unit="batch"):
        result = session.serve(batch)
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        for b, request in enumerate(result.request_ids.tolist()):
            logits[request] = result.logits[offsets[b]:offsets[b + 1]].numpy()
    cache.close()
    return logits, ideal_history_tokens(model.layout, dataset, stream)


def ideal_history_tokens(layout, dataset: InferenceDataset, stream: np.ndarray) -> dict[int, int]:
    """History tokens each visit computes when the cache always holds the user's previous visit."""
    req, held, out = dataset.requests, {}, {}
    for i in stream.tolist():
        user, end = int(req.user_id[i]), np.array([req.end[i]])
        start, length = held.get(user, (0, 0))
        out[i] = int(layout.visit_spans(end, np.array([start]), np.array([length])).history_lengths[0])
        window = int(layout.window_start(end)[0])
        held[user] = (window, int(layout.window_tokens(end)[0]))
    return out


def node_memory(model, dataset: InferenceDataset, stream: np.ndarray, args) -> tuple[int, int]:
    """(device pages, host bytes) per node, as shares of the replayed users' working set."""
    cfg = model.config
    working, _ = working_set_pages(model, dataset, stream, cfg.page_size)
    pages_of = page_layout(cfg, torch.float32)
    pages = max(int(working / args.nodes * args.device_share), 2 * pages_of.num_pages(cfg.max_seq_len))
    host_bytes = int(working / args.nodes * args.host_share * pages_of.page_nbytes)
    return pages, host_bytes


# ---------------------------------------------------------------- the cluster
def reset(nodes: list[Service], redis: LocalRedisServer) -> None:
    for node in nodes:
        urllib.request.urlopen(urllib.request.Request(f"{node.url}/admin/reset_cache", b"", method="POST"), timeout=120)
    redis.client().flushdb()


def router_metrics(router: Service) -> str:
    with urllib.request.urlopen(f"{router.url}/metrics", timeout=10) as resp:
        return resp.read().decode()


@dataclass
class Run:
    """The cluster and the workloads every policy is measured on."""

    nodes: list[Service]
    redis: LocalRedisServer
    warm: list[ScoreQuery]  # each user's last visit before the replay (not measured)
    stream: list[ScoreQuery]  # replayed at --rate
    saturation: list[ScoreQuery]  # then sent closed-loop
    probe: list[ScoreQuery]  # router overhead
    args: argparse.Namespace
    workdir: Path
    fingerprint: str  # the model's: the locality index's namespace


def run_policy(policy: str, run: Run, fault: bool = False, probe: bool = True) -> tuple[list[Sent], dict]:
    nodes, redis, warm, stream, saturation, args = run.nodes, run.redis, run.warm, run.stream, run.saturation, run.args
    workdir = run.workdir
    reset(nodes, redis)
    router = start_router([n.address for n in nodes], policy, workdir / "logs", redis.url,
                          extra_args=["--seed", str(args.seed), "--load_slack", str(args.load_slack),
                                      "--queue_cost_tokens", str(args.queue_cost_tokens)])
    extra: dict = {}
    try:
        wait_healthy([router], timeout_s=60)
        asyncio.run(replay(router.url, warm, rate=float("inf"), desc=f"{policy}: warm-up", progress=not args.quiet,
                           max_in_flight=2 * len(nodes)))
        label = f"{policy}: fault run" if fault else f"{policy}: replay at {args.rate:g}/s"

        async def replay_with_fault():
            task = asyncio.ensure_future(replay(router.url, stream, rate=args.rate, seed=args.seed, desc=label,
                                                progress=not args.quiet))
            if fault:
                extra["killed_after_s"] = len(stream) / args.rate / 2
                await asyncio.sleep(extra["killed_after_s"])
                extra.update(kill_busiest(nodes, redis, run.fingerprint))
            return await task

        sent = asyncio.run(replay_with_fault())
        extra["router_metrics"] = router_metrics(router)
        if saturation and not fault:
            saturated = asyncio.run(replay(router.url, saturation, rate=float("inf"), desc=f"{policy}: saturation",
                                           progress=not args.quiet, max_in_flight=4 * len(nodes)))
            extra["saturation"] = latency_summary(saturated) | {"visits": sum(s.ok for s in saturated)}
        if policy == "kv-aware" and not fault and probe and args.overhead_rounds:
            extra["router_overhead"] = asyncio.run(overhead_probe(router, nodes, run.probe,
                                                                  args.overhead_rounds))
    finally:
        router.stop(timeout_s=10)
    return sent, extra


def kill_busiest(nodes: list[Service], redis: LocalRedisServer, fingerprint: str) -> dict:
    """SIGKILL the node the index says holds the most users (mid-replay)."""
    client, keys = redis.client(), IndexKeys(fingerprint)
    held = {n.address: client.hlen(keys.users(n.address)) for n in nodes}
    victim = max(nodes, key=lambda n: held[n.address])
    victim.kill()
    log.info("killed node %s (it held %d users)", victim.address, held[victim.address])
    return {"killed": victim.address, "victim_users_held": held[victim.address]}


def dump_visits(path: Path, runs: dict[str, list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        out.write("policy,replay,position,user,sent_s,latency_ms,status,node,tier,tokens_reused,tokens_computed,"
                  "batch_size,queue_ms,compute_ms\n")
        for policy, replays in runs.items():
            for replay_no, (sent, _) in enumerate(replays):
                for s in sent:
                    b = s.body if s.ok else {}
                    c = b.get("cache", {})
                    out.write(f"{policy},{replay_no},{s.position},{s.query.user_id},{s.sent_s:.4f},{s.latency_s * 1000:.2f},"
                              f"{s.status},{b.get('node', '')},{c.get('tier', '')},{c.get('tokens_reused', '')},"
                              f"{c.get('tokens_computed', '')},{b.get('batch_size', '')},{b.get('queue_ms', '')},"
                              f"{b.get('compute_ms', '')}\n")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)  # imports configured the root
    log.setLevel(logging.INFO)
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICY_NAMES))
    if unknown or not policies:
        build_parser().error(f"--policies: unknown {unknown}; choose from {', '.join(POLICY_NAMES)}")
    if redis_server_binary() is None:
        build_parser().error("redis-server is not installed (apt-get install redis-server)")
    torch.set_num_threads(1)
    dataset = InferenceDataset(args.data_dir)
    model = load_checkpoint(args.checkpoint).model
    from_ms = beijing_midnight_ms(args.from_date)
    indices = dataset.request_indices(from_time_ms=from_ms, max_requests=args.max_requests)
    warm_idx = warmup_indices(dataset, indices, from_ms)
    after = dataset.request_indices(from_time_ms=from_ms)[len(indices):][:args.saturation_requests]
    expected, ideal = offline_reference(model, dataset, warm_idx, np.concatenate([indices, after]), not args.quiet)
    pages, host_bytes = node_memory(model, dataset, np.concatenate([warm_idx, indices, after]), args)
    warm, stream, saturation = (visit_queries(dataset, i) for i in (warm_idx, indices, after))
    log.info("%d visits of %d users at %g/s over %d nodes (each: %d device pages, %.0f MiB host tier)", len(indices),
             len(np.unique(dataset.requests.user_id[indices])), args.rate, args.nodes, pages, host_bytes / 2**20)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cluster-benchmark-")).resolve()  # redis-server chdirs
    node_args = ["--admin", "--kv_pages", str(pages), "--host_capacity_mb", str(max(1, host_bytes >> 20)),
                 "--max_batch_size", str(args.max_batch_size), "--max_wait_ms", str(args.max_wait_ms),
                 "--torch_threads", "1", "--log_level", "WARNING"]
    report: dict = {"config": {**vars(args), "device_pages_per_node": pages, "host_bytes_per_node": host_bytes,
                               "visits": len(indices), "warmup_visits": len(warm_idx)}, "policies": {}}
    with LocalRedisServer(workdir / "redis") as redis:
        nodes = [start_node(args.data_dir, args.checkpoint, workdir / "logs", redis.url, extra_args=node_args,
                            name=f"node{i}") for i in range(args.nodes)]
        try:
            started = time.perf_counter()
            wait_healthy(nodes, timeout_s=600)
            log.info("%d nodes up in %.0f s", len(nodes), time.perf_counter() - started)
            run = Run(nodes, redis, warm, stream, saturation, probe_queries(dataset, stream), args, workdir,
                      model_fingerprint(model))
            runs: dict[str, list] = {policy: [] for policy in policies}
            for repeat in range(args.repeats):  # the order alternates, so that a drift in the machine's load evens out
                for policy in (policies if repeat % 2 == 0 else policies[::-1]):
                    runs[policy].append(run_policy(policy, run, probe=repeat == 0))
            for policy in policies:
                report["policies"][policy] = summarize_repeats(runs[policy], expected, ideal, args.rate)
            if args.dump_visits:
                dump_visits(Path(args.dump_visits), runs)
            if not args.no_fault:
                sent, extra = run_policy("kv-aware", run, fault=True)
                report["fault"] = summarize(sent, expected, ideal, extra, args.rate, fault=True)
        finally:
            for node in nodes:
                node.stop(timeout_s=60)
    output = Path(args.output)
    write_json(output, report, default=str)
    plot(report, output.with_suffix(".png"))
    print(table(report))
    print(f"wrote {output} and {output.with_suffix('.png')}; process logs in {workdir / 'logs'}")
    return 0 if report.get("fault", {}).get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
