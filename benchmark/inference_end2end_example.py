"""Replay KuaiRand-1K visits in time order with the KV cache and with full recompute.

    python benchmark/inference_end2end_example.py --data_dir artifacts/processed \\
        --checkpoint artifacts/checkpoint --output artifacts/end2end.json

Both passes serve the same visits (from --from_date on) through model.InferenceSession.
The cached pass fetches only the events each user's cache lacks, offloads users to the
host tier between visits and, with a device pool smaller than the working set, evicts
and reloads them. The logits of the two passes are compared request by request; the
script exits non-zero if they differ beyond --tolerance. Results go to stdout, to the
JSON file and to a PNG (latency against history length).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from data.dataset import InferenceDataset
from data.schema import TASKS, beijing_midnight_ms
from end2end_args import DTYPES, build_parser, parse_args, plot_path, refuse
from kvcache import KVCacheConfig, KVCacheManager
from model.cache_config import kv_cache_config, page_layout
from model.checkpoint import CheckpointError, load_checkpoint, model_fingerprint
from model.config import config_for_dataset
from model.cuda_graphs import use_cuda_graphs
from model.fresh_model import fresh_model
from model.inference import InferenceSession
from model.recommender import HSTURecommender
from model.replay import ReplayPass, compare, replay
from model.train_params import RECIPES, TrainParams
from model.warm_up import warm_up
from serving_cost import ServingCost, probe, probed_batches

log = logging.getLogger("end2end")


def load_model(args: argparse.Namespace, dataset: InferenceDataset) -> HSTURecommender:
    expected_features = tuple(dataset.user_feature_cardinalities)
    if args.checkpoint is None:
        log.warning("WARNING: no --checkpoint given: serving a RANDOMLY INITIALISED model "
                    "(parity and speed are meaningful, AUCs are not)")
        torch.manual_seed(args.seed)
        if args.recipe is None:
            config = config_for_dataset(args.preset, dataset)
            if args.attention_window is not None:
                config = config.replace(attention_window=args.attention_window)
            model = HSTURecommender(config, device=args.device)
        else:  # the start of training: the recipe's shape and initial weights
            recipe = {**RECIPES[args.recipe], "attention_window": args.attention_window}
            model = fresh_model(dataset, TrainParams(preset=args.preset, device=args.device, **recipe))
    else:
        model = load_checkpoint(args.checkpoint, device=args.device, attention_window=args.attention_window).model
        if model.config.use_contextual_prefix and model.config.user_feature_cardinalities != expected_features:
            raise CheckpointError(
                f"Checkpoint {args.checkpoint} was trained for user-feature vocabularies "
                f"{list(model.config.user_feature_cardinalities)}, the data in {args.data_dir} has "
                f"{list(expected_features)}: retrain on this data"
            )
    return model.to(DTYPES[args.dtype]).eval()


def window_pages(model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray, page_size: int) -> np.ndarray:
    """[n] pages the window of each request occupies in the cache."""
    return -(-model.layout.window_tokens(dataset.requests.end[indices]) // page_size)


def working_set_pages(model: HSTURecommender, dataset: InferenceDataset, indices: np.ndarray,
                      page_size: int) -> tuple[int, int]:
    """-> (pages to keep every replayed user's largest window on the device at once,
           pages of the largest single window)."""
    users = dataset.requests.user_id[indices]
    largest = {}
    for u, n in zip(users.tolist(), window_pages(model, dataset, indices, page_size).tolist()):
        largest[u] = max(largest.get(u, 0), n)
    return sum(largest.values()), max(largest.values())


def largest_batch_pages(model: HSTURecommender, dataset: InferenceDataset, batches: list[np.ndarray],
                        page_size: int) -> int:
    """The fewest device pages that serve every batch: the users of a batch cannot evict one
    another, so the pool must hold all their windows at once."""
    return max((int(window_pages(model, dataset, b, page_size).sum()) for b in batches), default=0)


def warmup_batches(dataset: InferenceDataset, indices: np.ndarray, from_ms: int, batch_size: int) -> list[np.ndarray]:
    """Each replayed user's last visit before the replay window: serving it leaves the cache
    exactly as if every earlier visit had been served (cache contents depend only on the window)."""
    req = dataset.requests
    users = np.unique(req.user_id[indices])
    earlier = dataset.request_indices(until_time_ms=from_ms)
    earlier = earlier[np.isin(req.user_id[earlier], users)]
    _, last_pos = np.unique(req.user_id[earlier][::-1], return_index=True)
    last = np.sort(earlier[::-1][last_pos])
    return list(dataset.batches(last, batch_size))


def cache_config(args: argparse.Namespace, model: HSTURecommender, working_set: int, largest_window: int,
                 page_size: int, fingerprint: str) -> KVCacheConfig:
    """By default the device pool holds a quarter of the working set (so users are evicted and
    reloaded) but always at least one full batch of the largest windows."""
    num_pages = args.kv_pages
    if num_pages is None:
        num_pages = max(working_set // 4, args.batch_size * largest_window)
    bytes_per_page = page_layout(model.config, DTYPES[args.dtype], page_size).page_nbytes
    host_capacity = args.host_capacity
    if host_capacity is None:
        host_capacity = int(working_set * bytes_per_page * 1.5) + bytes_per_page
    return kv_cache_config(
        model.config, num_pages=num_pages, page_size=page_size, keep_unread_kv=args.keep_unread_kv,
        dtype=DTYPES[args.dtype], device=args.device, host_capacity_bytes=host_capacity, async_offload=args.async_offload,
        kv_codec=args.kv_codec, **tier_settings(args, fingerprint),
    )


def tier_settings(args: argparse.Namespace, fingerprint: str) -> dict:
    """KVCacheConfig fields of the tier below host memory. Redis keys are namespaced by the
    model fingerprint, so nodes serving another model never read these K/V."""
    if args.kv_tier == "disk":
        return {"persistent_dir": args.kv_dir, "persistent_capacity_bytes": args.tier_capacity}
    if args.kv_tier == "redis":
        return {"redis_url": args.redis_url, "redis_namespace": fingerprint, "redis_capacity_bytes": args.tier_capacity}
    return {}


def plot(passes: list[ReplayPass], path: Path, batch_size: int) -> None:
    """Batch latency against the batch's history length (per request when batch_size is 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for p, color in zip(passes, ("tab:blue", "tab:red")):
        ax.scatter(p.batch_history_lengths, p.batch_latency_ms, s=6, alpha=0.5, color=color,
                   label=f"{p.name} (p50 {np.median(p.batch_latency_ms):.1f} ms per batch)")
    unit = "visit" if batch_size == 1 else f"batch of up to {batch_size} visits"
    ax.set_xlabel(f"history length (events, summed over the {unit})")
    ax.set_ylabel(f"latency per {unit} (ms)")
    ax.set_yscale("log")
    ax.set_title("Serving latency vs history length: KV cache vs full recompute")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser(__doc__)
    try:
        args = parse_args(parser, argv)
    except SystemExit as stop:  # argparse printed the error (or --help)
        return int(stop.code or 0)
    # What needs the data or the model is checked next, still before the long work.
    try:
        dataset = InferenceDataset(args.data_dir)
    except (FileNotFoundError, ValueError) as err:
        return refuse(parser, f"--data_dir: {err}")
    try:
        model = load_model(args, dataset)
    except (FileNotFoundError, ValueError) as err:
        flag = "--checkpoint" if args.checkpoint else "--recipe" if args.recipe else "--preset"
        return refuse(parser, f"{flag}: {err}")
    from_ms = beijing_midnight_ms(args.from_date)
    indices = dataset.request_indices(from_time_ms=from_ms, max_requests=args.max_requests)
    if len(indices) == 0:
        return refuse(parser, f"--from_date {args.from_date}: no visits in {args.data_dir} on or after that day")
    page_size = args.page_size if args.page_size is not None else model.config.page_size
    batches = list(dataset.batches(indices, args.batch_size))
    warmup = [] if args.no_warmup else warmup_batches(dataset, indices, from_ms, args.batch_size)
    pages_needed, largest_window = working_set_pages(model, dataset, indices, page_size)
    batch_pages = largest_batch_pages(model, dataset, warmup + batches, page_size)
    if args.kv_pages is not None and args.kv_pages < batch_pages:
        return refuse(parser, f"--kv_pages {args.kv_pages} is too small: the largest batch of this replay needs "
                              f"{batch_pages} pages of {page_size} tokens (give at least that, or a smaller --batch_size)")
    fingerprint = model_fingerprint(model)
    config = cache_config(args, model, pages_needed, largest_window, page_size, fingerprint)
    try:
        cache = KVCacheManager(config)
    except RuntimeError as err:  # the device pool is allocated up front
        return refuse(parser, f"the device pool of {config.num_pages} pages x {page_size} tokens "
                              f"({config.device_nbytes / 2**30:.1f} GiB) cannot be allocated on {config.device}: "
                              f"lower --kv_pages or --page_size ({str(err).splitlines()[0]})")
    except OSError as err:
        return refuse(parser, f"--kv_dir {args.kv_dir}: {err}")
    log.info("replaying %d visits of %d users in %d batches; device pool %d pages for a working set of %d pages",
             len(indices), len(np.unique(dataset.requests.user_id[indices])), len(batches),
             cache.config.num_pages, pages_needed)

    try:
        graphs = use_cuda_graphs(args.cuda_graphs, model.device, model.resolved_attention_backend())
    except ValueError as err:
        return refuse(parser, f"--cuda_graphs: {err}")
    # Every kernel variant both passes meet is compiled before either is timed (as a node does at start).
    kernel_warm_up = warm_up(model, [cache.config, None], graphs)
    cached_session = InferenceSession(model, dataset, kv_cache=cache, model_fingerprint=fingerprint,
                                      cuda_graphs=graphs)
    if warmup:
        replay(cached_session, warmup, "warm-up", progress=not args.quiet)
        cache.wait()
    cached = replay(cached_session, batches, "kv cache", progress=not args.quiet)
    cache.wait()
    passes = [cached]
    full = None
    if not args.no_compare:
        full = replay(InferenceSession(model, dataset, cuda_graphs=graphs), batches, "full recompute",
                      progress=not args.quiet)
        passes.append(full)

    costs = {} if args.no_cost_probe else probe_costs(args, model, dataset, config, fingerprint, batches, from_ms)
    task_names = TASKS
    ends = dataset.requests.end[indices]
    unread = model.layout.tokens_never_read_again(ends, model.config.attention_window)
    unread_share = float(unread.sum() / model.layout.window_tokens(ends).sum())
    report = {
        "num_requests": cached.num_requests,
        "num_users": len(np.unique(dataset.requests.user_id[indices])),
        "warmup_requests": int(sum(len(b) for b in warmup)),
        "batch_size": args.batch_size,
        "device": str(model.device),
        "dtype": args.dtype,
        "cuda_graphs": graphs,
        "kernel_warm_up": kernel_warm_up.as_dict(),
        "model": model.config.to_dict(),
        "window_tokens_never_read_again": unread_share,
        "checkpoint": args.checkpoint,
        "seconds": {p.name: p.seconds for p in passes},
        "throughput_rps": {p.name: p.num_requests / p.seconds if p.seconds else None for p in passes},
        "latency_ms": {p.name: p.latency_percentiles() for p in passes},
        "tokens_computed": {p.name: p.tokens_computed for p in passes},
        "tokens_reused": {p.name: p.tokens_reused for p in passes},
        "auc": {p.name: p.auc(task_names) for p in passes},
        "cache": asdict(cache.stats()),
        "tag_mismatches": cached_session.tag_mismatches,
        "serving_cost": {name: None if c is None else asdict(c) for name, c in costs.items()},
        "cache_config": {"num_pages": cache.config.num_pages, "page_size": page_size, "tier": args.kv_tier,
                         "kv_codec": cache.config.kv_codec,
                         "read_window": cache.config.read_window and asdict(cache.config.read_window),
                         "working_set_pages": pages_needed, "host_capacity_bytes": cache.config.host_capacity_bytes},
    }
    ok = True
    if full is not None:
        parity = compare(cached, full)
        ok = parity.within(args.tolerance)
        report.update({
            "speedup": full.seconds / cached.seconds,
            "max_abs_logit_diff": parity.max_abs_diff,
            "logit_scale": parity.logit_scale,
            "worst_request_id": parity.worst_request_id,
            "tolerance": args.tolerance,
            "parity": "pass" if ok else "FAIL",
        })
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    png = plot_path(args)
    plot(passes, png, args.batch_size)
    report["plot"] = str(png)
    output.write_text(json.dumps(report, indent=2, default=_json_default))
    print_summary(report, passes, task_names)
    print(f"\nresults: {output}\nplot:    {png}")
    if not ok:
        print(f"error: cached and full-recompute logits differ by {report['max_abs_logit_diff']:.3g} "
              f"(> {args.tolerance:g}) at request {report['worst_request_id']}", file=sys.stderr)
        return 1
    return 0


def probe_costs(args: argparse.Namespace, model: HSTURecommender, dataset: InferenceDataset, config: KVCacheConfig,
                fingerprint: str, batches: list[np.ndarray], from_ms: int) -> dict[str, ServingCost | None]:
    """Ops, syncs and (CUDA) GPU-busy fraction per served batch of each pass, on sessions of their
    own after the timed passes. The cached probe's cache keeps only the in-memory host tier, so it
    never touches the persistent or shared tier the replay used."""
    probed = probed_batches(batches)
    warmup = [] if args.no_warmup else warmup_batches(dataset, np.concatenate(probed), from_ms, args.batch_size)
    probe_config = dataclasses.replace(config, persistent_dir=None, redis_url=None)
    caches: list[KVCacheManager] = []

    def cached_session() -> InferenceSession:
        caches.append(KVCacheManager(probe_config))
        return InferenceSession(model, dataset, kv_cache=caches[-1], model_fingerprint=fingerprint)

    costs = {"kv cache": probe(cached_session, warmup, probed, model.device, close=lambda: caches[-1].close())}
    if not args.no_compare:
        costs["full recompute"] = probe(lambda: InferenceSession(model, dataset), [], probed, model.device)
    return costs


def print_summary(report: dict, passes: list[ReplayPass], task_names: tuple[str, ...]) -> None:
    rows = [("", *[p.name for p in passes])]
    rows.append(("requests", *[str(p.num_requests) for p in passes]))
    rows.append(("total time (s)", *[f"{p.seconds:.2f}" for p in passes]))
    rows.append(("throughput (req/s)", *[f"{p.num_requests / p.seconds:.1f}" for p in passes]))
    for q in ("p50", "p90", "p99"):
        rows.append((f"latency {q} (ms)", *[f"{report['latency_ms'][p.name][q]:.1f}" for p in passes]))
    rows.append(("tokens computed", *[f"{p.tokens_computed:,}" for p in passes]))
    rows.append(("tokens reused", *[f"{p.tokens_reused:,}" for p in passes]))
    costs = report.get("serving_cost") or {}
    if all(costs.get(p.name) for p in passes):
        rows.append(("aten ops per batch", *[f"{costs[p.name]['ops_per_batch']:,.0f}" for p in passes]))
        rows.append(("kernel ops per batch", *[f"{costs[p.name]['kernel_ops_per_batch']:,.0f}" for p in passes]))
        rows.append(("host syncs per batch", *[f"{costs[p.name]['sync_ops_per_batch']:.0f}" for p in passes]))
        if all(costs[p.name]["gpu_busy"] is not None for p in passes):
            rows.append(("GPU busy", *[f"{costs[p.name]['gpu_busy']:.0%}" for p in passes]))
    for task in task_names:
        rows.append((f"AUC {task}", *[_fmt_auc(report["auc"][p.name][task]) for p in passes]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))
    if "speedup" in report:
        print(f"\nspeedup (full / cached): {report['speedup']:.2f}x   max |logit diff|: "
              f"{report['max_abs_logit_diff']:.3g} (scale {report['logit_scale']:.3g}, tolerance "
              f"{report['tolerance']:g}) -> parity {report['parity']}")
    c = report["cache"]
    print("cache: " + ", ".join(f"{k}={v}" for k, v in c.items()))


def _fmt_auc(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")


if __name__ == "__main__":
    sys.exit(main())
