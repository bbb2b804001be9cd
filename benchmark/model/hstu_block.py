"""HSTU block benchmark: incremental (KV cache) vs full recompute at the same shapes.

    python -m benchmark.model.hstu_block [--preset kuairand-1k] [--dtype bfloat16] [--cuda_graphs]
                                         [--histories ...] [--batches ...] [--output hstu_block.json]

For each history length L and batch size B, every user has L history tokens of which
all but the last --new_tokens are already in the paged KV cache, and --candidates
candidates to score. Timed, in the same run:
  * cached: prepare_kv_cache -> plan and upload the batch -> embeddings and every layer (append new
            K/V, attend over the pages) -> head -> rollback
  * full:   the same over all L history tokens + candidates, nothing cached
plus a plain torch.matmul of the shape of the cached path's largest GEMM, so the cached
path's achieved FLOP rate is reported as a fraction of what this machine's matmul reaches.
Each shape also reports the aten ops (and kernel-running ops, and sync ops) of one cached
batch, and on CUDA the fraction of wall time the GPU was busy. With --cuda_graphs both paths
replay their bucket's CUDA graph (model/cuda_graphs.py) after host planning and one upload.
The embedding tables are shrunk so the model fits anywhere (lookups are a small part).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from benchmark.cli import add_output
from benchmark.device_profile import OpCounts, gpu_busy_fraction, sync
from benchmark.report import write_json
from benchmark.workloads import add_model_flags, model_from_flags, visit_batches
from kvcache import KVCacheManager
from model.cache_config import kv_cache_config
from model.config import HSTUConfig
from model.cuda_graphs import CUDAGraphs
from model.kv_store import PagedKV
from model.recommender import HSTURecommender


@dataclass(frozen=True)
class Row:
    history: int
    batch: int
    cached_ms: float
    full_ms: float
    speedup: float
    flop_ratio: float  # full-path FLOPs / cached-path FLOPs
    cached_gflops: float  # achieved by the cached path
    matmul_gflops: float  # plain torch.matmul of the cached path's projection shape
    cached_vs_matmul: float
    cached_ops: int  # aten ops of one cached batch (prepare, upload, forward, rollback)
    cached_kernel_ops: int  # of which run a kernel
    cached_sync_ops: int
    gpu_busy: float | None  # CUDA: kernel time / wall time of the cached path


def layer_flops(cfg: HSTUConfig, new: int, cached: int, candidates: int, history_outputs: bool) -> float:
    """Multiply-adds x 2 of one HSTU layer for one user (causal blocks counted as computed)."""
    d, a = cfg.hidden_dim, cfg.attention_dim
    tokens = new + candidates
    projections = 2 * tokens * d * 4 * a
    window = cached + new
    # history query i attends keys [0, cached + i], or its last attention_window of them
    reach = cfg.attention_window or window
    hist_keys = float(np.minimum(cached + np.arange(1, new + 1), reach).sum()) if history_outputs else 0.0
    attention = 2 * 2 * a * (hist_keys + candidates * (min(window, reach) + 1))  # QK^T and AV; +1: itself
    output = 2 * (tokens if history_outputs else candidates) * a * d
    return projections + attention + output


def model_flops(cfg: HSTUConfig, new: int, cached: int, candidates: int) -> float:
    return sum(layer_flops(cfg, new, cached, candidates, i < cfg.num_layers - 1) for i in range(cfg.num_layers))


def timed_rounds(fns: list, repeats: int, warmup: bool = True) -> list[list[float]]:
    """Seconds of each function in each of `repeats` rounds, after one warm-up round unless the
    caller warmed them. Rounds interleave the functions, so load from other processes hits them alike."""
    if warmup:
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return samples


def timed(fns: list, repeats: int, warmup: bool = True) -> list[float]:
    """Median seconds of each function over `timed_rounds`."""
    return [statistics.median(s) for s in timed_rounds(fns, repeats, warmup)]


class VisitFns(NamedTuple):
    """One shape's visits, each a call that serves them and waits for the device."""

    cached: Callable[[], None]  # prepare -> plan and upload -> forward over the new tokens -> rollback
    full: Callable[[], None]  # every history token and the candidates, nothing cached
    prefill: Callable[[], None]  # every history token, no candidates, nothing cached
    kv_nbytes: int  # device bytes of the pages the cached visit's users hold


def visit_fns(model: HSTURecommender, history: int, batch: int, new: int, candidates: int,
              device: torch.device, graphs: CUDAGraphs | None = None) -> VisitFns:
    """B users of `history` tokens, all but the last `new` of them in the paged KV cache (random K/V:
    values do not change the cost), each with `candidates` candidates to score."""
    cfg = model.config
    cached = history - new
    full_batch, new_batch = visit_batches(cfg, batch, history, new, candidates)
    prefill_batch, _ = visit_batches(cfg, batch, history, new, 0)
    pages_per_user = math.ceil(history / cfg.page_size) + 1
    manager = KVCacheManager(kv_cache_config(
        cfg, num_pages=batch * pages_per_user, dtype=model.dtype, device=device, host_capacity_bytes=1 << 20,
    ))
    users = list(range(batch))
    prefill = manager.prepare_kv_cache(users, [0] * batch, [cached] * batch)
    for layer in range(cfg.num_layers):
        manager.k_cache(layer).normal_()
        manager.v_cache(layer).normal_()
    manager.commit(prefill)

    def forward(batch_, kv=None):
        if graphs is None:
            return model.run(model.prepare_inputs(batch_, kv), kv)
        return graphs.run(model.prepare_inputs(batch_, kv, bucketed=True), kv)

    def run_cached():
        meta = manager.prepare_kv_cache(users, [cached] * batch, [new] * batch)
        forward(new_batch, PagedKV(manager, meta))
        manager.rollback(meta)
        sync(device)

    def run_uncached(batch_):
        forward(batch_)
        sync(device)

    kv_nbytes = batch * manager.config.page_layout.num_pages(history) * manager.config.page_layout.page_nbytes
    return VisitFns(run_cached, lambda: run_uncached(full_batch), lambda: run_uncached(prefill_batch), kv_nbytes)


def bench_shape(model: HSTURecommender, history: int, batch: int, new: int, candidates: int,
                repeats: int, device: torch.device, graphs: CUDAGraphs | None = None) -> Row:
    cfg = model.config
    cached = history - new
    dtype = model.dtype
    visits = visit_fns(model, history, batch, new, candidates, device, graphs)
    run_cached, run_full = visits.cached, visits.full

    a = torch.randn(batch * (new + candidates), cfg.hidden_dim, device=device, dtype=dtype)
    b = torch.randn(cfg.hidden_dim, 4 * cfg.attention_dim, device=device, dtype=dtype)

    def run_matmul():
        torch.matmul(a, b)
        sync(device)

    with torch.inference_mode():
        t_cached, t_full, t_matmul = timed([run_cached, run_full, run_matmul], repeats)
        ops = OpCounts.of(run_cached)
        busy = gpu_busy_fraction(run_cached, device)
    f_cached = batch * model_flops(cfg, new, cached, candidates)
    f_full = batch * model_flops(cfg, history, 0, candidates)
    cached_gflops = f_cached / t_cached / 1e9
    matmul_gflops = 2 * a.shape[0] * a.shape[1] * b.shape[1] / t_matmul / 1e9
    return Row(history, batch, t_cached * 1e3, t_full * 1e3, t_full / t_cached, f_full / f_cached,
               cached_gflops, matmul_gflops, cached_gflops / matmul_gflops, ops.ops, ops.kernels, ops.syncs, busy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--histories", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cuda_graphs", action="store_true", help="replay each bucket's CUDA graph (CUDA only)")
    add_output(p, "hstu_block_benchmark.json")
    args = p.parse_args(argv)

    model = model_from_flags(p, args)
    device = model.device
    if args.cuda_graphs and device.type != "cuda":
        p.error("--cuda_graphs needs --device cuda")
    if max(args.histories) > model.config.max_seq_len:
        p.error(f"history {max(args.histories)} exceeds the preset's max_seq_len {model.config.max_seq_len}")
    graphs = CUDAGraphs(model) if args.cuda_graphs else None
    shapes = [(h, b) for b in args.batches for h in args.histories]
    rows = []
    for history, batch in tqdm(shapes, desc="shapes", file=sys.stderr):
        rows.append(bench_shape(model, history, batch, args.new_tokens, args.candidates, args.repeats, device, graphs))

    header = f"{'history':>7} {'batch':>5} {'cached ms':>10} {'full ms':>10} {'speedup':>8} {'FLOP ratio':>10} " \
             f"{'cached GFLOP/s':>14} {'matmul GFLOP/s':>14} {'cached/matmul':>13} {'ops':>6} {'kernels':>7} " \
             f"{'syncs':>5} {'GPU busy':>8}"
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"preset {args.preset}, {args.dtype} on {device_name}, {torch.get_num_threads()} threads, "
          f"CUDA graphs {'on' if graphs else 'off'}; {args.new_tokens} new tokens, {args.candidates} candidates per user")
    print(header)
    for r in rows:
        busy = "-" if r.gpu_busy is None else f"{r.gpu_busy:.0%}"
        print(f"{r.history:>7} {r.batch:>5} {r.cached_ms:>10.2f} {r.full_ms:>10.2f} {r.speedup:>7.2f}x "
              f"{r.flop_ratio:>9.2f}x {r.cached_gflops:>14.1f} {r.matmul_gflops:>14.1f} {r.cached_vs_matmul:>12.0%} "
              f"{r.cached_ops:>6} {r.cached_kernel_ops:>7} {r.cached_sync_ops:>5} {busy:>8}")
    result = {"preset": args.preset, "dtype": args.dtype, "device": device_name, "threads": torch.get_num_threads(),
              "cuda_graphs": bool(graphs), "new_tokens": args.new_tokens, "candidates": args.candidates,
              "rows": [asdict(r) for r in rows]}
    write_json(args.output, result)
    print(f"results: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
