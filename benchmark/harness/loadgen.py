"""An open-loop load generator: replay score requests at an arrival rate, a user's visits in order.

Arrivals are a Poisson process of `rate` per second (seeded), in stream order. A user does not
come back before its previous visit was answered: a visit whose user is still waiting is sent
when that answer arrives (the queueing a real user imposes), so a user's visits reach the
cluster in order. Latency runs from sending to the full answer.

    sent = asyncio.run(replay("http://127.0.0.1:8000", queries, rate=20.0))
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
from tqdm import tqdm

from benchmark.harness.visits import query_body
from serve.protocol import ScoreQuery


@dataclass(frozen=True)
class Sent:
    """One request's outcome."""

    position: int  # in the stream
    query: ScoreQuery
    status: int  # HTTP status; 0 when no answer came (connection error, timeout)
    body: dict | None
    sent_s: float  # since the replay began
    latency_s: float
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.body is not None


async def post(session: aiohttp.ClientSession, url: str, query: ScoreQuery, timeout_s: float) -> tuple[int, dict | None, str]:
    try:
        async with session.post(f"{url}/score", data=query_body(query), timeout=aiohttp.ClientTimeout(total=timeout_s),
                                headers={"Content-Type": "application/json"}) as resp:
            raw = await resp.read()
            return resp.status, json.loads(raw), ""
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
        return 0, None, f"{type(err).__name__}: {err}"


def arrival_times(count: int, rate: float, seed: int) -> np.ndarray:
    """[count] seconds since the start: a Poisson process of `rate` per second (inf: all at once)."""
    if rate == float("inf"):
        return np.zeros(count)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=count))


async def replay(url: str, queries: Sequence[ScoreQuery], rate: float, seed: int = 0, timeout_s: float = 120.0,
                 desc: str = "replay", progress: bool = True, max_in_flight: int | None = None) -> list[Sent]:
    """Send every query (see the module docstring) and wait for all answers; in stream order."""
    times = arrival_times(len(queries), rate, seed)
    previous: dict[int, asyncio.Future] = {}  # user -> answer of its latest visit so far
    limit = asyncio.Semaphore(max_in_flight) if max_in_flight else None
    bar = tqdm(total=len(queries), desc=desc, unit="visit", disable=not progress, file=sys.stderr)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(position: int, query: ScoreQuery, before: asyncio.Future | None, done: asyncio.Future) -> Sent:
            try:
                await asyncio.sleep(max(0.0, times[position] - (time.perf_counter() - start)))
                if before is not None:
                    await before
                if limit is not None:
                    await limit.acquire()
                try:
                    sent = time.perf_counter()
                    status, body, error = await post(session, url, query, timeout_s)
                    latency = time.perf_counter() - sent
                finally:
                    if limit is not None:
                        limit.release()
                bar.update()
                return Sent(position, query, status, body, sent - start, latency, error)
            finally:
                done.set_result(None)

        tasks = []
        loop = asyncio.get_running_loop()
        for position, query in enumerate(queries):
            done = loop.create_future()
            tasks.append(asyncio.ensure_future(one(position, query, previous.get(query.user_id), done)))
            previous[query.user_id] = done
        results = await asyncio.gather(*tasks)
    bar.close()
    return list(results)


def latency_summary(sent: Sequence[Sent]) -> dict[str, float]:
    """p50 / p90 / p99 / mean latency (ms) and throughput (answers per second over the replay's span)."""
    ok = [s for s in sent if s.ok]
    if not ok:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0, "throughput_rps": 0.0}
    latency = np.array([s.latency_s for s in ok]) * 1000.0
    span = max(s.sent_s + s.latency_s for s in ok) - min(s.sent_s for s in ok)
    return {
        "p50_ms": float(np.percentile(latency, 50)),
        "p90_ms": float(np.percentile(latency, 90)),
        "p99_ms": float(np.percentile(latency, 99)),
        "mean_ms": float(latency.mean()),
        "throughput_rps": len(ok) / span if span > 0 else 0.0,
    }
