"""Micro-benchmarks of the KV cache, as ratios measured in the same run (robust on a noisy machine).

* append_kvcache: a batch of users x new tokens into every layer, vs `Tensor.copy_` of the same
  bytes between preallocated tensors (target >= 0.7x memcpy bandwidth);
* offload / reload of whole users through the in-memory host tier, vs `copy_` of the same bytes
  (target >= 0.5x);
* prepare_kv_cache for a batch of 64 with 1,000 vs 100,000 users known to the manager
  (target <= 20 us per user, and the large case <= 1.5x the small one).

Each op and its baseline are timed in alternation; a ratio is the median of the per-round ratios.

    python -m benchmark.kvcache.ops --output artifacts/kvcache_ops.json
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from benchmark.cli import add_device, add_output
from benchmark.report import write_json
from kvcache import KVCacheConfig, KVCacheManager, paged_kvcache_ops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # by the short names the results are keyed by


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, setup=None) -> float:
    if setup is not None:
        setup()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _paired(op, baseline, device, rounds, op_setup=None) -> dict:
    """Time op and baseline alternately; ratio = baseline time / op time (1.0 = memcpy speed)."""
    for _ in range(2):  # warm-up
        _time(op, device, op_setup)
        _time(baseline, device)
    op_t, base_t = [], []
    for _ in range(rounds):
        op_t.append(_time(op, device, op_setup))
        base_t.append(_time(baseline, device))
    return {
        "op_s_median": statistics.median(op_t),
        "copy_s_median": statistics.median(base_t),
        "ratio_vs_copy": statistics.median(b / o for b, o in zip(base_t, op_t)),
    }


def _populate(mgr: KVCacheManager, users: list[int], tokens: int, batch: int = 1000, append: bool = False) -> None:
    """Give every user `tokens` committed tokens (random K/V when `append`)."""
    cfg = mgr.config
    for i in range(0, len(users), batch):
        chunk = users[i : i + batch]
        meta = mgr.prepare_kv_cache(chunk, [0] * len(chunk), [tokens] * len(chunk))
        if append:
            n = meta.num_new_tokens
            for layer in range(cfg.num_layers):
                kv = torch.randn(2, n, cfg.num_heads, cfg.head_dim, device=cfg.device).to(cfg.dtype)
                paged_kvcache_ops.append_kvcache(mgr.k_cache(layer), mgr.v_cache(layer), kv[0], kv[1], meta.new_token_slots)
        mgr.commit(meta)


def bench_append(dtype: torch.dtype, device: torch.device, rounds: int, users=32, new_tokens=128, cached=100) -> dict:
    cfg = KVCacheConfig(num_layers=3, num_heads=4, head_dim=128, page_size=32, num_pages=users * 8, dtype=dtype, device=device)
    mgr = KVCacheManager(cfg)
    ids = list(range(users))
    _populate(mgr, ids, cached)  # the new tokens start in a partial page
    meta = mgr.prepare_kv_cache(ids, [cached] * users, [new_tokens] * users)
    n = meta.num_new_tokens
    new = torch.randn(cfg.num_layers, 2, n, cfg.num_heads, cfg.head_dim, device=device).to(dtype)
    dst = torch.ones_like(new)  # baselines touch their memory first: reading never-written pages is free
    caches = [(mgr.k_cache(layer), mgr.v_cache(layer)) for layer in range(cfg.num_layers)]
    slots = meta.new_token_slots

    def append():
        for layer, (k, v) in enumerate(caches):
            paged_kvcache_ops.append_kvcache(k, v, new[layer, 0], new[layer, 1], slots)

    def copy():
        for layer in range(cfg.num_layers):
            dst[layer, 0].copy_(new[layer, 0])
            dst[layer, 1].copy_(new[layer, 1])

    out = _paired(append, copy, device, rounds)
    kv_slots = meta.kv_slots
    gather_dst = torch.ones((cfg.num_layers, 2, kv_slots.numel(), cfg.num_heads, cfg.head_dim), dtype=dtype, device=device)
    src = torch.ones_like(gather_dst)

    def gather():
        for k, v in caches:
            paged_kvcache_ops.gather_kvcache(k, v, kv_slots)

    gathered = _paired(gather, lambda: gather_dst.copy_(src), device, rounds)
    mgr.rollback(meta)
    return {
        "users": users, "new_tokens_per_user": new_tokens, "layers": cfg.num_layers,
        "bytes": new.numel() * new.element_size(),
        **out,
        "gather_ratio_vs_copy": gathered["ratio_vs_copy"],
    }


def bench_offload_reload(dtype: torch.dtype, device: torch.device, rounds: int, users=32, tokens=512) -> dict:
    cfg = KVCacheConfig(
        num_layers=3, num_heads=4, head_dim=128, page_size=32, num_pages=users * tokens // 32,
        dtype=dtype, device=device, host_capacity_bytes=4 << 30,
    )
    mgr = KVCacheManager(cfg)
    ids = list(range(users))
    _populate(mgr, ids, tokens, append=True)
    nbytes = users * cfg.page_layout.num_pages(tokens) * cfg.page_layout.page_nbytes
    src = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.ones(nbytes // dtype.itemsize, dtype=dtype, pin_memory=cfg.pin_host_memory)
    d2h = lambda: dst.copy_(src)
    h2d = lambda: src.copy_(dst)
    host = mgr._host  # the benchmark empties the host tier between rounds, so every round moves every page

    def drop_host():
        for u in ids:
            host.drop(u)

    offload = _paired(lambda: mgr.offload_kv_cache(ids), d2h, device, rounds, op_setup=drop_host)
    mgr.offload_kv_cache(ids)
    metas = []

    def evict():
        for m in metas:
            mgr.commit(m)
        metas.clear()
        mgr.evict_kv_cache()

    reload = _paired(lambda: metas.append(mgr.prepare_kv_cache(ids, [tokens] * users, [0] * users)), h2d, device,
                     rounds, op_setup=evict)
    evict()
    first = KVCacheManager(cfg)  # a cold host tier: its memory is touched for the first time
    _populate(first, ids, tokens)
    cold = _time(lambda: first.offload_kv_cache(ids), device)
    return {
        "users": users, "tokens_per_user": tokens, "bytes": nbytes,
        "offload": offload, "reload": reload,
        "offload_cold_ratio_vs_copy": offload["copy_s_median"] / cold,
    }


def bench_prepare(known_sizes: tuple[int, ...], device: torch.device, rounds: int, batch=64, cached=30, new=8) -> dict:
    """Per-user cost of prepare for a batch of random resident users, managers of each size timed in alternation.

    Every prepare is rolled back (untimed), so each round sees the same state.
    """
    managers = {}
    for known in known_sizes:
        cfg = KVCacheConfig(num_layers=1, num_heads=1, head_dim=4, page_size=32, num_pages=known + 4 * batch, device=device)
        managers[known] = KVCacheManager(cfg)
        _populate(managers[known], list(range(known)), cached)
    rng = random.Random(0)
    times: dict[int, list[float]] = {known: [] for known in known_sizes}
    for i in range(rounds + 5):
        for known, mgr in managers.items():
            users = rng.sample(range(known), batch)
            _sync(device)
            t0 = time.perf_counter()
            meta = mgr.prepare_kv_cache(users, [cached] * batch, [new] * batch)
            _sync(device)
            if i >= 5:
                times[known].append(time.perf_counter() - t0)
            mgr.rollback(meta)
    return {
        str(known): {"users_known": known, "batch": batch,
                     "us_per_user_median": statistics.median(t) / batch * 1e6,
                     "us_per_user_best": min(t) / batch * 1e6}
        for known, t in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device(parser)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per measurement (median reported)")
    parser.add_argument("--prepare-rounds", type=int, default=1000)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    add_output(parser, help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    small = dict(users=4, new_tokens=16) if args.quick else {}

    results: dict = {"device": str(device), "torch": torch.__version__, "machine": platform.machine(),
                     "threads": torch.get_num_threads(), "append": {}, "offload_reload": {}, "prepare": {}}
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'append_kvcache':<34}{'MB':>8}{'ratio vs copy_':>16}{'gather ratio':>14}")
    for name, dtype in DTYPES.items():
        r = bench_append(dtype, device, rounds, **small)
        results["append"][name] = r
        print(f"  {r['users']}x{r['new_tokens_per_user']} tokens, {r['layers']} layers {name:<6}"
              f"{r['bytes'] / 1e6:>8.1f}{r['ratio_vs_copy']:>15.2f}x{r['gather_ratio_vs_copy']:>13.2f}x")

    print(f"{'offload / reload (in-memory host)':<34}{'MB':>8}{'offload':>10}{'reload':>10}{'cold offload':>14}")
    sizes = dict(users=4, tokens=64) if args.quick else {}
    for name, dtype in DTYPES.items():
        r = bench_offload_reload(dtype, device, rounds, **sizes)
        results["offload_reload"][name] = r
        print(f"  {r['users']} users x {r['tokens_per_user']} tokens {name:<9}{r['bytes'] / 1e6:>8.1f}"
              f"{r['offload']['ratio_vs_copy']:>9.2f}x{r['reload']['ratio_vs_copy']:>9.2f}x"
              f"{r['offload_cold_ratio_vs_copy']:>13.2f}x")

    print(f"{'prepare_kv_cache, batch 64':<34}{'us/user (median)':>18}{'best':>8}")
    known_sizes = (200, 2_000) if args.quick else (1_000, 100_000)
    results["prepare"] = bench_prepare(known_sizes, device, 20 if args.quick else args.prepare_rounds)
    for known in known_sizes:
        r = results["prepare"][str(known)]
        print(f"  {known:>7} users known{'':<15}{r['us_per_user_median']:>18.2f}{r['us_per_user_best']:>8.2f}")
    small_k, large_k = (results["prepare"][str(k)]["us_per_user_median"] for k in known_sizes)
    results["prepare"]["large_over_small"] = large_k / small_k
    print(f"  {known_sizes[1]} vs {known_sizes[0]} users known: {large_k / small_k:.2f}x")

    if args.output:
        write_json(args.output, results)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
