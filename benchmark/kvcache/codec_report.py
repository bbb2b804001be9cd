"""What each K/V codec costs in quality and saves in bytes, on one replay of KuaiRand-1K visits.

    python -m benchmark.kvcache.codec_report --data_dir artifacts/processed --checkpoint artifacts/checkpoint \\
        --codecs raw zstd bf16 int8 int8:mode=affine mixed --output artifacts/kv_codecs.json

The replay of inference_end2end_example.py runs once with full recompute and once per codec with
the KV cache. The warm-up (each replayed user's last earlier visit) runs once, on a raw cache, and
is copied into each codec's tiers, so every returning user starts there and its first visit onloads
what the codec kept; the device pool is a quarter of the working set (users are evicted and
onloaded again), as the example's. Per codec: max and mean |logit diff| against the raw
(uncompressed) cached pass, every task's AUC and its change against full recompute, the bytes per
token the host tier stores and its ratio to the raw pages of the same entries (a windowed model's
unread K/V leave the device as zeros unless `--keep_unread_kv`: kvcache/read_window.py). The full-recompute
pass is replayed once per run, or once for several runs with `--full_reference PATH`.
Onload time per codec: benchmark/kvcache/tiers.py --kv_codecs.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from benchmark.cli import add_checkpoint, add_data_dir, add_output
from benchmark.report import write_json
from benchmark.serving.end2end_args import replay_defaults
from benchmark.serving.replay_setup import cache_config, load_model, warmup_batches, working_set_pages
from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, TASKS, beijing_midnight_ms
from kvcache import KVCacheManager
from kvcache.codecs import get_codec
from kvcache.testing import copy_users
from model.checkpoint import model_fingerprint
from model.inference import InferenceSession
from model.replay import ReplayPass, replay


def codec_spec(text: str) -> str:
    try:
        return get_codec(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def stored_bytes_per_token(cache: KVCacheManager, users: np.ndarray) -> tuple[float, float]:
    """(host-tier bytes, raw page bytes of the same entries) over the tokens its entries hold (the replayed
    users all fit in it). The raw in-memory tier's bytes include its size-class slack; the page bytes do not."""
    host, layout = cache.host_storage, cache.config.page_layout
    lengths = [e.length for e in (host.info(int(u)) for u in users) if e is not None]
    tokens = sum(lengths)
    if not tokens:
        return float("nan"), float("nan")
    return host.bytes_used / tokens, sum(layout.num_pages(n) for n in lengths) * layout.page_nbytes / tokens


def full_reference(args, model, dataset, batches) -> ReplayPass:
    """The full-recompute pass, read from `--full_reference` when that file holds it for these requests,
    else replayed (and saved there): a report per codec group reuses one reference."""
    path = Path(args.full_reference) if args.full_reference else None
    if path is not None and path.exists():
        with np.load(path) as saved:
            fields = {f.name: saved[f.name] for f in dataclasses.fields(ReplayPass)}
        ref = ReplayPass(**{k: v.item() if v.ndim == 0 else v for k, v in fields.items()})
        if np.array_equal(ref.request_ids, dataset.requests.request_id[np.concatenate(batches)]):
            return ref
    ref = replay(InferenceSession(model, dataset), batches, "full recompute", progress=False)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            np.savez(f, **dataclasses.asdict(ref))
    return ref


def warm_cache(args, model, dataset, warmup, pages_needed, largest) -> KVCacheManager:
    """A raw cache after the warm-up (each replayed user's last earlier visit), large enough that it
    evicts no one: computed once, then copied into every codec's cache."""
    fingerprint = model_fingerprint(model)
    config = cache_config(args, model, pages_needed, largest, model.config.page_size, fingerprint)
    cache = KVCacheManager(dataclasses.replace(config, num_pages=pages_needed + args.batch_size * largest))
    replay(InferenceSession(model, dataset, kv_cache=cache, model_fingerprint=fingerprint), warmup, "warm-up",
           progress=False)
    return cache


def run_codec(args, model, dataset, spec, batches, warm, pages_needed, largest) -> tuple[ReplayPass, tuple, dict]:
    """One replay with host tiers of codec `spec`, every warm user starting in them (so its first
    visit onloads what the codec kept); the device pool a quarter of the working set, as the example's."""
    fingerprint = model_fingerprint(model)
    config = dataclasses.replace(cache_config(args, model, pages_needed, largest, model.config.page_size, fingerprint),
                                 kv_codec=spec)
    users = np.unique(dataset.requests.user_id[np.concatenate(batches)])
    with KVCacheManager(config) as cache:
        copy_users(warm, cache, users.tolist())
        session = InferenceSession(model, dataset, kv_cache=cache, model_fingerprint=fingerprint)
        result = replay(session, batches, spec, progress=False)
        cache.offload_kv_cache()
        return result, stored_bytes_per_token(cache, users), dataclasses.asdict(cache.stats())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p)
    add_checkpoint(p, help="model.train output (omit: a random-init --preset model)")
    p.add_argument("--preset", default="demo", help="the random-init model's preset (without --checkpoint)")
    p.add_argument("--codecs", nargs="+", type=codec_spec, default=["raw", "zstd", "zstd-channel", "bf16", "int8", "mixed"])
    p.add_argument("--from_date", type=int, default=DEFAULT_SPLIT_DATE)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_requests", type=int, default=None, help="replay only the first N visits (150: minutes on CPU)")
    p.add_argument("--full_reference", default=None,
                   help="an .npz keeping the full-recompute pass: replayed once, then reused by later runs")
    p.add_argument("--keep_unread_kv", action="store_true",
                   help="store the K/V a windowed model never reads again as they are (default: as zeros, exact)")
    add_output(p, "kv_codecs.json")
    # the replay's defaults for what load_model and cache_config read (kv_codec: replaced per pass), on the CPU
    args = replay_defaults(**vars(p.parse_args(argv)), device="cpu")
    dataset = InferenceDataset(args.data_dir)
    model = load_model(args, dataset)
    from_ms = beijing_midnight_ms(args.from_date)
    indices = dataset.request_indices(from_time_ms=from_ms, max_requests=args.max_requests)
    batches = list(dataset.batches(indices, args.batch_size))
    warmup = warmup_batches(dataset, indices, from_ms, args.batch_size)
    pages_needed, largest = working_set_pages(model, dataset, indices, model.config.page_size)
    started = time.perf_counter()
    full = full_reference(args, model, dataset, batches)
    full_auc = full.auc(TASKS)
    print(f"full recompute: {full.num_requests} visits ({time.perf_counter() - started:.0f} s)", flush=True)
    specs = ["raw", *[s for s in args.codecs if s != "raw"]]
    warm = warm_cache(args, model, dataset, warmup, pages_needed, largest)
    cache_window = warm.config.read_window
    rows, reference = {}, None
    for spec in specs:
        started = time.perf_counter()
        result, per_token, stats = run_codec(args, model, dataset, spec, batches, warm, pages_needed, largest)
        reference = reference or result
        diff = np.abs(result.logits - reference.logits)
        auc = result.auc(TASKS)
        rows[spec] = {
            "max_abs_logit_diff_vs_raw": float(diff.max()), "mean_abs_logit_diff_vs_raw": float(diff.mean()),
            "max_abs_logit_diff_vs_full": float(np.abs(result.logits - full.logits).max()),
            "auc": auc, "delta_auc_vs_full": {t: None if auc[t] is None else auc[t] - full_auc[t] for t in TASKS},
            "bytes_per_token": per_token[0], "raw_page_bytes_per_token": per_token[1],
            "bytes_ratio_vs_raw_pages": per_token[1] / per_token[0], "onloaded_bytes": stats["onloaded_bytes"],
            "tokens_reused": result.tokens_reused, "seconds": result.seconds,
        }
        print(f"{spec}: {time.perf_counter() - started:.0f} s", flush=True)
        report = {"data_dir": args.data_dir, "checkpoint": args.checkpoint, "num_requests": full.num_requests,
                  "read_window": None if cache_window is None else dataclasses.asdict(cache_window),
                  "full_recompute_auc": full_auc, "codecs": rows}
        write_json(args.output, report)  # after every codec: a cut run keeps its rows
    print(f"{'codec':<56} {'B/token':>8} {'ratio':>6} {'max|dlogit|':>11} {'mean|dlogit|':>12} {'max|dAUC|':>9}")
    for spec, r in rows.items():
        worst = max((abs(v) for v in r["delta_auc_vs_full"].values() if v is not None), default=float("nan"))
        print(f"{spec:<56} {r['bytes_per_token']:>8.0f} {r['bytes_ratio_vs_raw_pages']:>6.2f} "
              f"{r['max_abs_logit_diff_vs_raw']:>11.3g} {r['mean_abs_logit_diff_vs_raw']:>12.3g} {worst:>9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
