"""Tier benchmark: reloading a returning user's KV from each tier vs recomputing its history.

    python -m benchmark.kvcache.tiers [--tiers memory disk redis] [--histories 256 ... 8192]
                                      [--threads N] [--redis_url URL] [--output artifacts/tier_benchmark.json]

For each history length L (kuairand-1k geometry: 3 layers, 4 heads x 128, page 32):
  * reload (per tier): the user's L tokens are in the tier, not on the device. Timed through
    the KVCacheManager, as a returning user costs: `prepare_kv_cache` of 1 new token (tier
    `info` + `read` + onload into fresh device pages + metadata), then `rollback`; the user is
    evicted from the device again, untimed, before each round.
  * recompute: the model's layers over the L history tokens with nothing cached
    (`HSTURecommender.run` on a planned batch, no candidates): what a miss costs on top of
    scoring the candidates, which both paths pay.
Tiers: `memory` (InMemoryHostStorage), `disk` (DiskHostStorage in a temp dir, page cache warm:
the node wrote it), `redis` (RedisHostStorage on a redis-server started on loopback, or
--redis_url). Each round times the recompute and every tier's reload in alternation (the
machine is shared; drift hits both); medians over --repeats rounds after one warm-up.

`--attention_window W` times a model with a sliding attention window of W events and its cache's
read window (kvcache/read_window.py): the user's pages before its last W tokens are released on
the device and offloaded as zeros, so an onload copies only the live pages, and a compressing codec
stores and moves the rest in a few bytes each. Every row reports the bytes its tier stores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmark.cli import DTYPES, add_dtype, add_output
from benchmark.device_profile import sync
from benchmark.report import write_json
from benchmark.workloads import long_history_config, visit_batches
from kvcache import HostKVStorage, InMemoryHostStorage, KVCacheConfig, KVCacheManager, paged_kvcache_ops
from kvcache.codecs import DEFAULT_CODEC, get_codec
from kvcache.local_redis import LocalRedisServer, redis_server_binary
from kvcache.storage import DiskHostStorage
from kvcache.storage.encoded_memory_tier import EncodedMemoryStorage
from kvcache.storage.redis_tier import RedisHostStorage
from model.cache_config import kv_cache_config
from model.config import HSTUConfig, preset
from model.recommender import HSTURecommender

TIERS = ("memory", "disk", "redis")
USER = 0


@dataclass(frozen=True)
class Row:
    tier: str
    history: int
    reload_ms: float
    recompute_ms: float
    speedup: float  # median over rounds of recompute / reload (> 1: reloading wins)
    stored_bytes: int = 0  # what the tier holds of the user


TierFactory = Callable[[int], HostKVStorage]  # history length -> an empty tier


def tier_factories(names: list[str], workdir: Path, redis_url: str, capacity: int,
                   codecs: list[str] = (DEFAULT_CODEC,)) -> dict[str, TierFactory]:
    """One factory per tier and codec, named `tier` (raw) or `tier codec`."""

    def make(name: str, codec: str) -> TierFactory:
        if name == "memory":
            if codec == DEFAULT_CODEC:
                return lambda history: InMemoryHostStorage(capacity)
            return lambda history: EncodedMemoryStorage(capacity, codec)
        if name == "disk":
            return lambda history: DiskHostStorage(workdir / f"disk-{codec}-{history}", capacity, codec=codec)
        namespace = f"tier-benchmark-{os.getpid()}-{codec}"
        return lambda history: RedisHostStorage(redis_url, f"{namespace}-{history}", capacity, codec=codec)

    return {name if codec == DEFAULT_CODEC else f"{name} {codec}": make(name, codec) for codec in codecs for name in names}


def cache_config(model_cfg: HSTUConfig, dtype: torch.dtype, history: int, device: torch.device | str = "cpu"
                 ) -> KVCacheConfig:
    """A device pool just large enough for one user of `history` + 1 tokens (with the model's read window)."""
    return kv_cache_config(model_cfg, num_pages=-(-(history + 1) // model_cfg.page_size), dtype=dtype, device=device)


def loaded_cache(model_cfg: HSTUConfig, dtype: torch.dtype, history: int, storage: HostKVStorage,
                 device: torch.device | str = "cpu") -> KVCacheManager:
    """A manager whose host tier holds `history` tokens of USER (random K/V) and whose device does not."""
    cache = KVCacheManager(cache_config(model_cfg, dtype, history, device), host_storage=storage)
    meta = cache.prepare_kv_cache([USER], [0], [history])
    for layer in range(model_cfg.num_layers):
        k, v = torch.randn(2, history, model_cfg.num_heads, model_cfg.head_dim, dtype=dtype, device=device)
        paged_kvcache_ops.append_kvcache(cache.k_cache(layer), cache.v_cache(layer), k, v, meta.new_token_slots)
    cache.commit(meta)
    cache.offload_kv_cache([USER])
    cache.evict_kv_cache([USER])
    return cache


def time_reload(cache: KVCacheManager, history: int) -> float:
    """Seconds of the prepare (onload of `history` tokens + 1 new) and rollback of a returning user."""
    cache.evict_kv_cache([USER])
    sync(cache.config.device)
    start = time.perf_counter()
    meta = cache.prepare_kv_cache([USER], [history], [1])
    cache.rollback(meta)
    sync(cache.config.device)
    elapsed = time.perf_counter() - start
    if meta.cached_lengths.tolist() != [history]:
        raise RuntimeError(f"the tier did not return the user's {history} tokens: {meta.cached_lengths.tolist()}")
    return elapsed


def recompute_fn(model: HSTURecommender, history: int) -> Callable[[], None]:
    """The model over `history` tokens with nothing cached (no candidates)."""
    full, _ = visit_batches(model.config, 1, history, 0, 0)
    inputs = model.prepare_inputs(full)
    return lambda: model.run(inputs)


def bench_history(model: HSTURecommender, factories: dict[str, TierFactory], history: int, repeats: int,
                  progress: tqdm) -> list[Row]:
    caches = {name: loaded_cache(model.config, model.dtype, history, make(history)) for name, make in factories.items()}
    stored = {name: cache.host_storage.bytes_used for name, cache in caches.items()}
    recompute = recompute_fn(model, history)
    reload_s: dict[str, list[float]] = {name: [] for name in caches}
    recompute_s: list[float] = []
    try:
        with torch.inference_mode():
            for round_ in range(repeats + 1):  # round 0 warms up
                start = time.perf_counter()
                recompute()
                elapsed = time.perf_counter() - start
                times = {name: time_reload(cache, history) for name, cache in caches.items()}
                if round_:
                    recompute_s.append(elapsed)
                    for name, t in times.items():
                        reload_s[name].append(t)
                progress.update()
    finally:
        for cache in caches.values():
            cache.invalidate_kv_cache([USER])  # frees the tier's space (Redis keys, files)
            cache.close()
            cache.host_storage.close()  # the benchmark built it: the manager does not own it
    return [
        Row(name, history, statistics.median(ts) * 1e3, statistics.median(recompute_s) * 1e3,
            statistics.median(r / t for r, t in zip(recompute_s, ts)), stored[name])
        for name, ts in reload_s.items()
    ]


def reload_vs_raw(rows: list[Row]) -> dict[str, float]:
    """`tier codec @ history` -> its reload time over the raw reload of the same tier and history (< 1: faster)."""
    raw = {(r.tier, r.history): r.reload_ms for r in rows if " " not in r.tier}
    return {f"{r.tier} @ {r.history}": r.reload_ms / raw[r.tier.split(" ")[0], r.history]
            for r in rows if " " in r.tier and (r.tier.split(" ")[0], r.history) in raw}


def crossover(rows: list[Row], tier: str) -> int | None:
    """The shortest tested history from which reloading beats recomputing at every longer one (None: never)."""
    best = None
    for row in sorted((r for r in rows if r.tier == tier), key=lambda r: -r.history):
        if row.speedup <= 1.0:
            break
        best = row.history
    return best


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    p.add_argument("--histories", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--kv_codecs", nargs="+", default=[DEFAULT_CODEC],
                   help="codec specs the tiers store pages with (kvcache.codecs), each timed as a tier of its own")
    p.add_argument("--attention_window", type=int, default=0,
                   help="a model with a sliding attention window of this many events, its cache releasing the rest "
                        "(0: every key)")
    p.add_argument("--repeats", type=int, default=5)
    add_dtype(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--redis_url", default=None, help="an existing Redis (default: start redis-server on loopback)")
    p.add_argument("--workdir", default=None, help="where the disk tier writes (default: a temp dir)")
    add_output(p, "artifacts/tier_benchmark.json")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.attention_window < 0:
        p.error(f"--attention_window must be >= 0 (0: every key), got {args.attention_window}")

    dtype = DTYPES[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    longest = max(args.histories)
    cfg = long_history_config(preset("kuairand-1k", video_hash_size=1024), longest)  # embeddings are not timed
    cfg = cfg.replace(attention_window=args.attention_window)
    torch.manual_seed(0)
    model = HSTURecommender(cfg).to(dtype).eval()
    layout = cache_config(cfg, dtype, longest).page_layout
    capacity = 2 * layout.num_pages(longest) * layout.page_nbytes  # every tier holds the user whole

    with ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        redis_url = args.redis_url
        if "redis" in args.tiers and redis_url is None:
            if redis_server_binary() is None:
                p.error("redis-server is not installed: pass --redis_url or leave out the redis tier")
            redis_url = stack.enter_context(LocalRedisServer(workdir / "redis")).url
        codecs = [get_codec(c).spec for c in args.kv_codecs]
        factories = tier_factories(args.tiers, workdir, redis_url, capacity, codecs)
        rows: list[Row] = []
        with tqdm(total=len(args.histories) * (args.repeats + 1), desc="rounds", file=sys.stderr) as progress:
            for history in args.histories:
                rows += bench_history(model, factories, history, args.repeats, progress)

    print(f"kuairand-1k geometry ({cfg.num_layers} layers, {cfg.num_heads} heads x {cfg.head_dim}, page "
          f"{cfg.page_size}), {args.dtype}, attention window {args.attention_window or 'none'}, "
          f"{torch.get_num_threads()} threads; medians of {args.repeats} rounds")
    print(f"{'tier':<28} {'history':>7} {'MB':>7} {'stored MB':>9} {'reload ms':>10} {'recompute ms':>13} "
          f"{'recompute/reload':>17}")
    for r in rows:
        print(f"{r.tier:<28} {r.history:>7} {r.history * layout.token_nbytes / 2**20:>7.1f} {r.stored_bytes / 2**20:>9.1f} "
              f"{r.reload_ms:>10.2f} {r.recompute_ms:>13.1f} {r.speedup:>16.1f}x")
    vs_raw = reload_vs_raw(rows)
    for name, ratio in vs_raw.items():
        print(f"{name}: reload {ratio:.2f}x the raw reload's time")
    crossovers = {tier: crossover(rows, tier) for tier in factories}
    for tier, length in crossovers.items():
        if length is None:
            print(f"{tier}: recompute is faster at the longest history tested")
        else:
            shortest = " (the shortest tested)" if length == min(args.histories) else ""
            print(f"{tier}: reload beats recompute from {length} tokens on{shortest}")
    result = {"preset": "kuairand-1k", "dtype": args.dtype, "attention_window": args.attention_window,
              "threads": torch.get_num_threads(),
              "repeats": args.repeats, "tiers": args.tiers, "histories": args.histories,
              "rows": [asdict(r) for r in rows], "crossover": crossovers,
              "reload_vs_raw": vs_raw}
    write_json(args.output, result)
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
