"""Kernel launches per served batch, and no host sync in the forward or the graph replay.

    python -m benchmark.model.launch_count --device cuda --dtype bfloat16 --output launches.json   # make gpu-report
    python -m benchmark.model.launch_count --device cpu --preset tiny --history 64 --output launches.json   # dry

For B = 1 and 8, users whose first H - --new_tokens tokens are cached score --candidates candidates:
one batch (prepare, plan and upload, forward, rollback) runs eagerly and, on CUDA, as its bucket's
CUDA graph replay. The forward and the replay run under `torch.cuda.set_sync_debug_mode("error")`:
an op in them that makes the host wait for the device raises; its row names it, its launches are
counted in a run without the check, and the script exits 1 with the results written. The batch runs
under the torch profiler, which counts its launches: on CUDA the host's kernel launch calls (cudaLaunch*
and the driver's cuLaunchKernel*, which Triton uses) and graph launches, and the kernels the GPU ran;
on CPU (the dry run) the CPU profiler's aten ops stand in for launches. A batch of 8 should cost
about what a batch of 1 does: a launch count that grew with the batch would be per-user work.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from benchmark.cli import add_output
from benchmark.report import write_json
from benchmark.workloads import add_model_flags, model_from_flags, visit_batches
from kvcache import KVCacheManager
from model.cache_config import kv_cache_config
from model.cuda_graphs import CUDAGraphs, use_cuda_graphs
from model.kv_store import PagedKV
from model.recommender import HSTURecommender

BATCHES = (1, 8)


@dataclass(frozen=True)
class LaunchRow:
    batch: int
    mode: str  # "eager" or "graph" (the bucket's CUDA graph replay)
    launches: int  # CUDA: kernel and graph launch calls of the host; CPU: aten ops (the CPU profiler's stand-in)
    device_kernels: int | None  # kernels the GPU ran (None off CUDA)
    sync_checked: bool  # the forward ran under set_sync_debug_mode("error") (CUDA only)
    host_sync: str | None  # the error of the op that synchronised (then counted again unchecked); None: none


@contextmanager
def no_host_syncs(device: torch.device) -> Iterator[None]:
    """Every op inside that would make the host wait for the device raises (CUDA; nothing to check elsewhere)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def count_launches(prof: profile, device: torch.device) -> tuple[int, int | None]:
    """-> (launches, device kernels) of the profiled events."""
    events = prof.events()
    if device.type != "cuda":
        return sum(e.name.startswith("aten::") for e in events), None
    launches = sum(e.device_type == torch.autograd.DeviceType.CPU
                   and ("LaunchKernel" in e.name or e.name == "cudaGraphLaunch") for e in events)
    kernels = sum(e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
                  for e in events)
    return launches, kernels


def measure(model: HSTURecommender, batch: int, history: int, new: int, candidates: int,
            graphs: CUDAGraphs | None) -> list[LaunchRow]:
    cfg, device = model.config, model.device
    cached = history - new
    _, new_batch = visit_batches(cfg, batch, history, new, candidates)
    manager = KVCacheManager(kv_cache_config(
        cfg, num_pages=batch * (math.ceil(history / cfg.page_size) + 1), dtype=model.dtype, device=device,
        host_capacity_bytes=1 << 20,
    ))
    users = list(range(batch))
    manager.commit(manager.prepare_kv_cache(users, [0] * batch, [cached] * batch))  # the cached prefix (zeros)
    modes: list[tuple[str, Callable]] = [("eager", model.run)]
    if graphs is not None:
        modes.append(("graph", graphs.run))
    def once(mode: str, forward: Callable, checked: bool) -> None:
        meta = manager.prepare_kv_cache(users, [cached] * batch, [new] * batch)
        kv = PagedKV(manager, meta)
        try:
            inputs = model.prepare_inputs(new_batch, kv, bucketed=mode == "graph")
            with no_host_syncs(device) if checked else nullcontext():
                forward(inputs, kv)
        finally:
            manager.rollback(meta)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode():
        for mode, forward in modes:
            once(mode, forward, checked=False)  # compiles the kernels and captures the graph, which synchronise
            host_sync = None
            try:
                with profile(activities=activities) as prof:
                    once(mode, forward, checked=True)
            except RuntimeError as err:  # a sync in the forward: named in the row, and the launches still counted
                if "synchroniz" not in str(err):
                    raise
                host_sync = str(err).splitlines()[0]
                with profile(activities=activities) as prof:
                    once(mode, forward, checked=False)
            rows.append(LaunchRow(batch, mode, *count_launches(prof, device), device.type == "cuda", host_sync))
    manager.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--history", type=int, default=4096)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--candidates", type=int, default=256)
    add_output(p, "launches.json")
    args = p.parse_args(argv)
    model = model_from_flags(p, args)
    device = model.device
    if not 0 < args.new_tokens < args.history <= model.config.max_seq_len:
        p.error(f"need 0 < --new_tokens < --history <= the preset's max_seq_len {model.config.max_seq_len}")
    graphs = CUDAGraphs(model) if use_cuda_graphs(None, device, model.resolved_attention_backend()) else None
    rows = [row for b in BATCHES for row in measure(model, b, args.history, args.new_tokens, args.candidates, graphs)]
    eager = {r.batch: r.launches for r in rows if r.mode == "eager"}
    result = {"preset": args.preset, "dtype": args.dtype, "device": str(device), "history": args.history,
              "new_tokens": args.new_tokens, "candidates": args.candidates,
              "launch_unit": "aten ops (CPU profiler)" if device.type != "cuda" else "kernel and graph launch calls",
              "eager_growth_1_to_8": eager[8] / eager[1], "rows": [asdict(r) for r in rows]}
    write_json(args.output, result)
    for r in rows:
        print(f"B={r.batch} {r.mode}: {r.launches} launches, {r.device_kernels} device kernels, "
              f"sync-checked {r.sync_checked}{f', HOST SYNC: {r.host_sync}' if r.host_sync else ''}")
    return 1 if any(r.host_sync for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
