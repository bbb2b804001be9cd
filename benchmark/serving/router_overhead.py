"""What the router adds to a request, on an idle cluster: the same requests straight to their node and
through the router, interleaved (the cluster benchmark's overhead probe, benchmark/serving/cluster.py)."""
from __future__ import annotations

import time

import numpy as np

from benchmark.harness.launch import Service
from benchmark.harness.loadgen import post
from data.dataset import InferenceDataset


def probe_queries(dataset: InferenceDataset, stream, users: int = 20):
    """The last replayed visit of the `users` users with the shortest histories (the least compute noise)."""
    last = list({q.user_id: q for q in stream}.values())
    ends = dataset.history_ends(np.array([q.user_id for q in last]), np.array([q.request_time_ms for q in last]))
    return [last[i] for i in np.argsort(ends, kind="stable")[:users]]


async def overhead_probe(router: Service, nodes: list[Service], queries, rounds: int) -> dict:
    """The same requests straight to their node and through the router, interleaved (the cluster is idle).

    Besides the end-to-end latencies it compares the time spent outside the node's batcher and
    model (latency minus the node's queue_ms + compute_ms), which takes the model's run-to-run
    noise out of the difference."""
    import aiohttp

    urls = {n.address: n.url for n in nodes}
    latency: dict[str, list[float]] = {"direct": [], "router": []}
    outside: dict[str, list[float]] = {"direct": [], "router": []}
    paired: list[float] = []  # router minus direct, the same request back to back
    async with aiohttp.ClientSession() as session:
        home = {}
        for q in queries:
            status, body, _ = await post(session, router.url, q, 60.0)
            if status == 200:
                home[q.user_id] = body["node"]
        for r in range(rounds):
            for q in queries:
                if q.user_id not in home:
                    continue
                order = (("direct", urls[home[q.user_id]]), ("router", router.url))
                pair = {}
                for path, url in (order if r % 2 else order[::-1]):
                    started = time.perf_counter()
                    status, body, _ = await post(session, url, q, 60.0)
                    elapsed = (time.perf_counter() - started) * 1000.0
                    if status == 200:
                        latency[path].append(elapsed)
                        outside[path].append(elapsed - body["queue_ms"] - body["compute_ms"])
                        pair[path] = elapsed
                if len(pair) == 2:
                    paired.append(pair["router"] - pair["direct"])
    p50 = {k: float(np.median(v)) for k, v in latency.items()}
    out50 = {k: float(np.median(v)) for k, v in outside.items()}
    return {"requests_each": len(latency["direct"]), "p50_direct_ms": p50["direct"], "p50_router_ms": p50["router"],
            "p50_overhead_ms": p50["router"] - p50["direct"], "ratio": p50["router"] / p50["direct"],
            "p50_outside_node_direct_ms": out50["direct"], "p50_outside_node_router_ms": out50["router"],
            "p50_outside_node_overhead_ms": out50["router"] - out50["direct"],
            "median_paired_overhead_ms": float(np.median(paired))}
