"""History ingest benchmark: how many events per second a history store appends, per batch size.

    python -m benchmark.history.ingest --store sqlite --store local-redis --out artifacts/history_ingest.json
    python -m benchmark.history.ingest --store redis://10.0.0.5:6379/0 --batch-sizes 100 1000

Stores: `sqlite` (a new file in --workdir: fsync cost is the disk's, pick the disk you will use),
`local-redis` (a redis-server on loopback with `appendonly yes`, `appendfsync always`, its AOF in
--workdir), or a URL: `sqlite:///path` (a new file; an existing one is refused) or `redis://...`
(a namespace of its own on that server, deleted afterwards). Every append is durable when it returns,
so small batches measure the fsync per call and large ones the store's work per event.

Events are KuaiRand-like: a time-ordered stream over many users (each batch size its own users, so no
event is late), videos drawn from a long-tailed catalogue, click / long-view rates as in the logs.
Each batch size appends `--events` events, or what fits in `--max-seconds`; only `append` is timed.
For Redis the server's memory growth per stored event is reported too (used_memory, approximate).

    batch   events  events/s  p50 ms  p99 ms
        1      512       870    1.10    2.31
     1000    20000     41000   23.80   31.02      (illustrative numbers)
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import redis
from tqdm import tqdm

from benchmark.report import write_json
from data import schema
from history import EventBatch, HistoryStore
from history.redis_store import RedisHistoryStore
from history.sqlite_store import SQLiteHistoryStore
from kvcache.local_redis import LocalRedisServer

BATCH_SIZES = (1, 10, 100, 1000)
USERS_PER_SIZE = 1000
VIDEOS = 50_000
ACTION_RATES = {"is_click": 0.35, "long_view": 0.25, "is_like": 0.02, "is_follow": 0.002, "is_comment": 0.003,
                "is_forward": 0.001, "is_hate": 0.001, "is_profile_enter": 0.01}


@dataclass(frozen=True)
class Row:
    store: str
    batch_size: int
    events: int
    seconds: float  # inside `append` only
    events_per_s: float
    p50_ms: float  # per append call
    p99_ms: float


def kuairand_like_events(n: int, first_user: int, rng: np.random.Generator) -> EventBatch:
    """[n] events of USERS_PER_SIZE users from `first_user` on, in time order (~50 events/s overall)."""
    time_ms = schema.beijing_midnight_ms(20220422) + np.cumsum(rng.integers(0, 40, n))
    duration = rng.integers(5_000, 120_000, n)
    play = (duration * rng.beta(0.8, 1.5, n)).astype(np.int64)
    columns = {
        "user_id": first_user + rng.integers(0, USERS_PER_SIZE, n),
        "video_id": np.minimum(rng.zipf(1.3, n), VIDEOS) - 1,
        "time_ms": time_ms, "play_time_ms": play, "duration_ms": duration,
        "tab": rng.integers(0, 10, n), "is_rand": np.zeros(n, np.int64),
        **{c: (rng.random(n) < p).astype(np.int64) for c, p in ACTION_RATES.items()},
    }  # fmt: skip
    return EventBatch.from_columns(columns)


def measure(store: HistoryStore, label: str, batch_size: int, events: EventBatch, max_seconds: float) -> Row:
    """Append `events` in batches of `batch_size` until done or `max_seconds` of appending."""
    latencies: list[float] = []
    appended = 0
    with tqdm(total=len(events), desc=f"{label} batch {batch_size}", unit="event", leave=False) as bar:
        for lo in range(0, len(events), batch_size):
            batch = events.take(slice(lo, lo + batch_size))
            start = time.perf_counter()
            store.append(batch)
            latencies.append(time.perf_counter() - start)
            appended += len(batch)
            bar.update(len(batch))
            if sum(latencies) >= max_seconds:
                break
    seconds = float(sum(latencies))
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
    return Row(label, batch_size, appended, round(seconds, 3), round(appended / seconds, 1), round(p50, 3), round(p99, 3))


def open_store(spec: str, workdir: Path, stack: ExitStack) -> tuple[HistoryStore, redis.Redis | None]:
    """The store a --store value names (closed by `stack`) and, for Redis, a client of its server for
    memory readings; a namespace on a server of the caller's is deleted at the end."""
    if spec == "local-redis":
        spec = stack.enter_context(LocalRedisServer(workdir / "redis", durable=True)).url
    if spec.startswith(("redis://", "rediss://", "unix://")):
        namespace = f"hstu:bench:{uuid.uuid4().hex[:12]}"
        client = stack.enter_context(redis.Redis.from_url(spec))
        stack.callback(_delete_keys, client, f"{namespace}:*")
        return stack.enter_context(RedisHistoryStore.from_url(spec, namespace=namespace, timeout_s=30)), client
    path = workdir / "history.sqlite" if spec == "sqlite" else Path(spec.removeprefix("sqlite://"))
    if path.exists():
        raise SystemExit(f"{path} exists: the benchmark writes a new store, give a path that does not exist")
    workdir.mkdir(parents=True, exist_ok=True)
    return stack.enter_context(SQLiteHistoryStore(path)), None


def _delete_keys(client: redis.Redis, pattern: str) -> None:
    keys = list(client.scan_iter(match=pattern, count=1000))
    for lo in range(0, len(keys), 1000):
        client.unlink(*keys[lo:lo + 1000])


def _used_memory(server: redis.Redis | None) -> int:
    return 0 if server is None else int(server.info("memory")["used_memory"])


def run(stores: list[str], batch_sizes: list[int], events: int, max_seconds: float, workdir: Path,
        seed: int = 0) -> dict:
    rows, memory = [], {}
    for spec in stores:
        rng = np.random.default_rng(seed)
        with ExitStack() as stack:
            store, server = open_store(spec, workdir / f"store-{len(rows)}", stack)
            kind = "sqlite" if server is None else "redis"
            before, stored = _used_memory(server), 0
            for i, size in enumerate(batch_sizes):
                row = measure(store, kind, size, kuairand_like_events(events, i * USERS_PER_SIZE, rng), max_seconds)
                rows.append(row)
                stored += row.events
            if server is not None:
                memory[store.description] = round((_used_memory(server) - before) / max(stored, 1), 1)
    return {"rows": [asdict(r) for r in rows], "redis_bytes_per_event": memory, "cpus": os.cpu_count()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", action="append", help="sqlite | local-redis | sqlite:///path | redis://... (repeatable)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--events", type=int, default=20_000, help="events per batch size (at most)")
    parser.add_argument("--max-seconds", type=float, default=10.0, help="appending time per batch size (at most)")
    parser.add_argument("--workdir", type=Path, help="where new stores and the local redis-server live (a temp dir)")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        result = run(args.store or ["sqlite", "local-redis"], args.batch_sizes, args.events, args.max_seconds, Path(tmp))
    print(f"{'store':>8} {'batch':>6} {'events':>8} {'events/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for r in result["rows"]:
        print(f"{r['store']:>8} {r['batch_size']:>6} {r['events']:>8} {r['events_per_s']:>10.0f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}")
    for where, per_event in result["redis_bytes_per_event"].items():
        print(f"{where}: ~{per_event:.0f} bytes of Redis memory per stored event")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
