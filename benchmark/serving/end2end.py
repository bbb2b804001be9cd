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
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmark.report import write_json
from benchmark.serving.end2end_args import build_parser, parse_args, plot_path, refuse
from benchmark.serving.end2end_report import plot, print_summary
from benchmark.serving.replay_setup import (
    cache_config,
    largest_batch_pages,
    load_model,
    log,
    warmup_batches,
    working_set_pages,
)
from benchmark.serving.serving_cost import ServingCost, probe, probed_batches
from data.dataset import InferenceDataset
from data.schema import TASKS, beijing_midnight_ms
from kvcache import KVCacheConfig, KVCacheManager
from model.checkpoint import model_fingerprint
from model.cuda_graphs import use_cuda_graphs
from model.inference import InferenceSession
from model.recommender import HSTURecommender
from model.replay import ReplayPass, compare, replay
from model.warm_up import WarmUpReport, warm_up


class Refused(Exception):
    """A value argparse could not judge (it needs the data or the model): reported as argparse reports one."""


@dataclass
class ReplayPlan:
    """What both passes serve, and the cache the cached pass serves it with."""

    dataset: InferenceDataset
    model: HSTURecommender
    from_ms: int
    indices: np.ndarray  # [n] the replayed requests
    batches: list[np.ndarray]
    warmup: list[np.ndarray]  # each replayed user's last earlier visit (empty with --no_warmup)
    page_size: int
    working_set_pages: int
    fingerprint: str
    config: KVCacheConfig
    cache: KVCacheManager


@dataclass
class ReplayResult:
    graphs: bool
    kernel_warm_up: WarmUpReport
    session: InferenceSession  # the cached pass's
    cached: ReplayPass
    full: ReplayPass | None  # None with --no_compare

    @property
    def passes(self) -> list[ReplayPass]:
        return [self.cached] if self.full is None else [self.cached, self.full]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = build_parser(__doc__)
    try:
        args = parse_args(parser, argv)
    except SystemExit as stop:  # argparse printed the error (or --help)
        return int(stop.code or 0)
    try:
        plan = plan_replay(args)
        graphs = cuda_graphs(args, plan.model)
    except Refused as refusal:
        return refuse(parser, str(refusal))
    result = run_passes(args, plan, graphs)
    costs = {} if args.no_cost_probe else probe_costs(args, plan.model, plan.dataset, plan.config, plan.fingerprint,
                                                      plan.batches, plan.from_ms)
    report = build_report(args, plan, result, costs)
    ok = check_parity(args, report, result)
    write_outputs(args, report, result.passes)
    if not ok:
        print(f"error: cached and full-recompute logits differ by {report['max_abs_logit_diff']:.3g} "
              f"(> {args.tolerance:g}) at request {report['worst_request_id']}", file=sys.stderr)
        return 1
    return 0


def load_inputs(args: argparse.Namespace) -> tuple[InferenceDataset, HSTURecommender]:
    """The dataset and the model, each checked before the long work starts."""
    try:
        dataset = InferenceDataset(args.data_dir)
    except (FileNotFoundError, ValueError) as err:
        raise Refused(f"--data_dir: {err}") from None
    try:
        model = load_model(args, dataset)
    except (FileNotFoundError, ValueError) as err:
        flag = "--checkpoint" if args.checkpoint else "--recipe" if args.recipe else "--preset"
        raise Refused(f"{flag}: {err}") from None
    return dataset, model


def plan_replay(args: argparse.Namespace) -> ReplayPlan:
    """The visits, their batches and warm-up, and a cache whose device pool holds the largest batch."""
    dataset, model = load_inputs(args)
    from_ms = beijing_midnight_ms(args.from_date)
    indices = dataset.request_indices(from_time_ms=from_ms, max_requests=args.max_requests)
    if len(indices) == 0:
        raise Refused(f"--from_date {args.from_date}: no visits in {args.data_dir} on or after that day")
    page_size = args.page_size if args.page_size is not None else model.config.page_size
    batches = list(dataset.batches(indices, args.batch_size))
    warmup = [] if args.no_warmup else warmup_batches(dataset, indices, from_ms, args.batch_size)
    pages_needed, largest_window = working_set_pages(model, dataset, indices, page_size)
    batch_pages = largest_batch_pages(model, dataset, warmup + batches, page_size)
    if args.kv_pages is not None and args.kv_pages < batch_pages:
        raise Refused(f"--kv_pages {args.kv_pages} is too small: the largest batch of this replay needs "
                      f"{batch_pages} pages of {page_size} tokens (give at least that, or a smaller --batch_size)")
    fingerprint = model_fingerprint(model)
    config = cache_config(args, model, pages_needed, largest_window, page_size, fingerprint)
    try:
        cache = KVCacheManager(config)
    except RuntimeError as err:  # the device pool is allocated up front
        raise Refused(f"the device pool of {config.num_pages} pages x {page_size} tokens "
                      f"({config.device_nbytes / 2**30:.1f} GiB) cannot be allocated on {config.device}: "
                      f"lower --kv_pages or --page_size ({str(err).splitlines()[0]})") from None
    except OSError as err:
        raise Refused(f"--kv_dir {args.kv_dir}: {err}") from None
    log.info("replaying %d visits of %d users in %d batches; device pool %d pages for a working set of %d pages",
             len(indices), len(np.unique(dataset.requests.user_id[indices])), len(batches),
             cache.config.num_pages, pages_needed)
    return ReplayPlan(dataset, model, from_ms, indices, batches, warmup, page_size, pages_needed, fingerprint,
                      config, cache)


def cuda_graphs(args: argparse.Namespace, model: HSTURecommender) -> bool:
    try:
        return use_cuda_graphs(args.cuda_graphs, model.device, model.resolved_attention_backend())
    except ValueError as err:
        raise Refused(f"--cuda_graphs: {err}") from None


def run_passes(args: argparse.Namespace, plan: ReplayPlan, graphs: bool) -> ReplayResult:
    """The timed passes: warm-up then the visits with the cache, then (unless --no_compare) full recompute."""
    model, dataset, cache = plan.model, plan.dataset, plan.cache
    # Every kernel variant both passes meet is compiled before either is timed (as a node does at start).
    kernel_warm_up = warm_up(model, [cache.config, None], graphs)
    cached_session = InferenceSession(model, dataset, kv_cache=cache, model_fingerprint=plan.fingerprint,
                                      cuda_graphs=graphs)
    if plan.warmup:
        replay(cached_session, plan.warmup, "warm-up", progress=not args.quiet)
        cache.wait()
    cached = replay(cached_session, plan.batches, "kv cache", progress=not args.quiet)
    cache.wait()
    full = None
    if not args.no_compare:
        full = replay(InferenceSession(model, dataset, cuda_graphs=graphs), plan.batches, "full recompute",
                      progress=not args.quiet)
    return ReplayResult(graphs, kernel_warm_up, cached_session, cached, full)


def build_report(args: argparse.Namespace, plan: ReplayPlan, result: ReplayResult,
                 costs: dict[str, ServingCost | None]) -> dict:
    model, dataset, cache, passes = plan.model, plan.dataset, plan.cache, result.passes
    ends = dataset.requests.end[plan.indices]
    unread = model.layout.tokens_never_read_again(ends, model.config.attention_window)
    return {
        "num_requests": result.cached.num_requests,
        "num_users": len(np.unique(dataset.requests.user_id[plan.indices])),
        "warmup_requests": int(sum(len(b) for b in plan.warmup)),
        "batch_size": args.batch_size,
        "device": str(model.device),
        "dtype": args.dtype,
        "cuda_graphs": result.graphs,
        "kernel_warm_up": result.kernel_warm_up.as_dict(),
        "model": model.config.to_dict(),
        "window_tokens_never_read_again": float(unread.sum() / model.layout.window_tokens(ends).sum()),
        "checkpoint": args.checkpoint,
        "seconds": {p.name: p.seconds for p in passes},
        "throughput_rps": {p.name: p.num_requests / p.seconds if p.seconds else None for p in passes},
        "latency_ms": {p.name: p.latency_percentiles() for p in passes},
        "tokens_computed": {p.name: p.tokens_computed for p in passes},
        "tokens_reused": {p.name: p.tokens_reused for p in passes},
        "auc": {p.name: p.auc(TASKS) for p in passes},
        "cache": asdict(cache.stats()),
        "tag_mismatches": result.session.tag_mismatches,
        "serving_cost": {name: None if c is None else asdict(c) for name, c in costs.items()},
        "cache_config": {"num_pages": cache.config.num_pages, "page_size": plan.page_size, "tier": args.kv_tier,
                         "kv_codec": cache.config.kv_codec,
                         "read_window": cache.config.read_window and asdict(cache.config.read_window),
                         "working_set_pages": plan.working_set_pages,
                         "host_capacity_bytes": cache.config.host_capacity_bytes},
    }


def check_parity(args: argparse.Namespace, report: dict, result: ReplayResult) -> bool:
    """Adds the two passes' comparison to `report`; -> whether their logits agree within --tolerance."""
    if result.full is None:
        return True
    parity = compare(result.cached, result.full)
    ok = parity.within(args.tolerance)
    report.update({
        "speedup": result.full.seconds / result.cached.seconds,
        "max_abs_logit_diff": parity.max_abs_diff,
        "logit_scale": parity.logit_scale,
        "worst_request_id": parity.worst_request_id,
        "tolerance": args.tolerance,
        "parity": "pass" if ok else "FAIL",
    })
    return ok


def write_outputs(args: argparse.Namespace, report: dict, passes: list[ReplayPass]) -> None:
    """The PNG, the JSON and the table on stdout."""
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    png = plot_path(args)
    plot(passes, png, args.batch_size)
    report["plot"] = str(png)
    write_json(output, report, default=_json_default)
    print_summary(report, passes, TASKS)
    print(f"\nresults: {output}\nplot:    {png}")


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


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    raise TypeError(f"not JSON serialisable: {type(value)}")


if __name__ == "__main__":
    sys.exit(main())
