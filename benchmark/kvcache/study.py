"""The KV-reuse study: what the cache saves a visit, what it costs in memory, and where reloading a
user's K/V from a tier stops paying. One command; the same on CPU and CUDA (picked automatically).

    python -m benchmark.kvcache.study [--output_dir artifacts/kv_study] [--histories 256 1024 4096 16384]
                                      [--tiers memory disk redis] [--codecs raw int8 ...] [--device cuda]

Writes `report.md`, its PNG figures and `results.json` to --output_dir and prints the report.
Sections (benchmark/kvcache/kvstudy/): 1. the share of a full visit spent on the history against the
candidates; 2. cached against full recompute; 3. K/V bytes per user per preset and dtype, device
pages against batch size and what limits the batch; 4. reload from each tier (memory, disk,
Redis on a redis-server of the run's own) per codec against recompute; 5. memory per served user
with and without the cache. Untrained (random-initialised) models at the preset's shapes: only
latency and memory are measured.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch

from benchmark.cli import SIZED_DTYPES, add_device, add_dtype, refuse_missing_cuda
from benchmark.kvcache.kvstudy import plots
from benchmark.kvcache.kvstudy.footprint import batch_limits, kv_bytes_table, memory_per_user, weights_bytes
from benchmark.kvcache.kvstudy.onload import crossovers, measure_onload, redis_url_for_run
from benchmark.kvcache.kvstudy.report import StudyResult, render
from benchmark.kvcache.kvstudy.visits import LONG_ROUNDS, measure_visits
from benchmark.kvcache.tiers import TIERS
from benchmark.report import write_json
from benchmark.workloads import long_history_config
from kvcache.codecs import DEFAULT_CODEC, codec_names, get_codec
from model.config import PRESET_NAMES, preset
from model.recommender import HSTURecommender


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="kuairand-1k", choices=PRESET_NAMES, help="the model timed")
    add_dtype(p, dtypes=SIZED_DTYPES)
    p.add_argument("--histories", type=int, nargs="+", default=[16, 64, 256, 1024, 4096, 16384],
                   help="history lengths (the short ones find where reloading stops paying)")
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=128, help="history tokens a cached visit appends (<= half)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per history (and per reload)")
    p.add_argument("--long_history", type=int, default=None,
                   help="histories above it get 2 timed rounds (default: 4096 on CPU, none on CUDA)")
    p.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS))
    p.add_argument("--codecs", nargs="+", default=None, help="kvcache.codecs specs (default: every registered codec)")
    p.add_argument("--presets", nargs="+", choices=PRESET_NAMES, default=["kuairand-1k", "demo"],
                   help="presets of the K/V bytes table")
    p.add_argument("--dtypes", nargs="+", choices=SIZED_DTYPES, default=["float32", "bfloat16"],
                   help="dtypes of that table")
    p.add_argument("--attention_windows", type=int, nargs="+", default=[0, 512],
                   help="sliding attention windows of section 3 (0: every key; 512: the recipe make demo trains)")
    p.add_argument("--batches", type=int, nargs="+", default=[2**i for i in range(11)], help="section 3's x axis")
    p.add_argument("--memory_batch", type=int, default=4,
                   help="the second batch size whose cached visit's peak memory is measured (>= 2)")
    add_device(p)
    p.add_argument("--device_memory_gb", type=float, default=80.0,
                   help="the device budget of section 3 off CUDA (default: an H100's 80 GB); CUDA uses the GPU's")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: 1 on CPU, where cores shared with other jobs make OpenMP threads "
                        "wait for one another, slower and noisier; torch's choice on CUDA)")
    p.add_argument("--redis_url", default=None, help="an existing Redis (default: start redis-server on loopback)")
    p.add_argument("--workdir", default=None, help="where the disk tier and Redis write (default: a temp dir)")
    p.add_argument("--output_dir", default="artifacts/kv_study")
    args = p.parse_args(argv)
    refuse_missing_cuda(p, args.device)
    if min(args.histories) < 1 or args.repeats < 1 or args.memory_batch < 2:
        p.error("histories and --repeats must be >= 1, --memory_batch >= 2")
    if min(args.attention_windows) < 0:
        p.error("--attention_windows must be >= 0 (0: every key)")
    for spec in args.codecs or ():
        try:
            get_codec(spec)
        except ValueError as exc:
            p.error(f"--codecs: {exc}")
    return args


def codecs_to_study(given: list[str] | None) -> list[str]:
    """The given codec specs, or every registered codec, the default (raw) first."""
    if given:
        return given
    return [DEFAULT_CODEC] + [name for name in codec_names() if name != DEFAULT_CODEC]


def device_budget(device: torch.device, memory_gb: float) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "the GPU's memory"
    return int(memory_gb * 2**30), f"--device_memory_gb {memory_gb:g}: a CPU has no device memory of its own"


def run_study(args: argparse.Namespace, command: str) -> StudyResult:
    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = SIZED_DTYPES[args.dtype]
    notes = []
    if args.threads:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        torch.set_num_threads(1)
        notes.append("One torch thread (the CPU default, --threads): on cores shared with other jobs two OpenMP "
                     "threads wait for each other at every barrier, which makes them slower and noisier.")
    codecs = codecs_to_study(args.codecs)
    long_history = args.long_history or (max(args.histories) if device.type == "cuda" else 4096)
    cfg = long_history_config(preset(args.preset, video_hash_size=1024, user_feature_cardinalities=()),
                              max(args.histories))
    torch.manual_seed(0)
    model = HSTURecommender(cfg, device=device).to(dtype).eval()
    tiers = list(args.tiers)
    with ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        redis_url = None
        if "redis" in tiers:
            redis_url, missing = stack.enter_context(redis_url_for_run(workdir, args.redis_url))
            if missing:
                tiers.remove("redis")
                notes.append(missing)
                print(f"NOTE: {missing}", file=sys.stderr)
        visits = measure_visits(model, args.histories, args.new_tokens, args.candidates, args.repeats, long_history,
                                args.memory_batch, device)
        onload = measure_onload(model, tiers, codecs, visits, args.repeats, workdir, redis_url, device)
    budget, budget_source = device_budget(device, args.device_memory_gb)
    weights = weights_bytes(args.preset, dtype)
    limits = batch_limits(cfg, dtype, visits, budget, weights, args.attention_windows)
    kv_rows = kv_bytes_table(args.presets, [SIZED_DTYPES[d] for d in args.dtypes], args.histories, args.attention_windows)
    memory = memory_per_user(visits)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "share": plots.history_share(visits, out / "share.png").name,
        "latency": plots.latency(visits, out / "latency.png").name,
        "kv_bytes": plots.kv_bytes(kv_rows, limits, args.batches, out / "kv_bytes.png").name,
        "memory": plots.memory(memory, out / "memory.png").name,
    }
    if onload:
        figures["onload"] = plots.onload(onload, out / "onload.png").name
    setup = {
        "command": command, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "threads": torch.get_num_threads(), "preset": args.preset, "dtype": args.dtype,
        "shape": f"{cfg.num_layers} layers, hidden {cfg.hidden_dim}, {cfg.num_heads} heads x {cfg.head_dim}, "
                 f"page {cfg.page_size}",
        "video_rows": cfg.video_hash_size, "candidates": args.candidates, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "long_history": long_history, "long_rounds": min(LONG_ROUNDS, args.repeats),
        "tiers": tiers, "codecs": codecs,
        "budget_bytes": budget, "budget_source": budget_source, "weights_bytes": weights, "notes": notes,
        "wall_s": time.perf_counter() - start,
    }
    return StudyResult(setup, visits, kv_rows, limits, onload, crossovers(onload), memory, figures)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = "python -m benchmark.kvcache.study" + "".join(" " + shlex.quote(a) for a in given)
    threads = torch.get_num_threads()
    try:
        result = run_study(args, command)
    finally:
        torch.set_num_threads(threads)  # main is also called in-process (the tests)
    out = Path(args.output_dir)
    report = render(result)
    (out / "report.md").write_text(report)
    write_json(out / "results.json", asdict(result))
    print(report)
    print(f"report: {out / 'report.md'}; results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
