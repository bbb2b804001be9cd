"""What each K/V codec costs in quality and saves in bytes, on one replay of KuaiRand-1K visits.

    python benchmark/kv_codec_report.py --data_dir artifacts/processed --checkpoint artifacts/checkpoint \\
        --codecs raw zstd bf16 int8 int8:mode=affine mixed --output artifacts/kv_codecs.json

The replay of inference_end2end_example.py (same warm-up, same device pool of a quarter of the
working set, so users are evicted and onloaded from the host tier) runs once with full recompute
and once per codec with the KV cache. Per codec: max and mean |logit diff| against the raw
(uncompressed) cached pass, every task's AUC and its change against full recompute, and the
bytes per token the host tier stores. Onload time per codec: benchmark/tier_benchmark.py --kv_codecs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
from inference_end2end_example import cache_config, load_model, warmup_batches, working_set_pages

from data.dataset import InferenceDataset
from data.schema import TASKS
from kvcache import KVCacheManager
from kvcache.codecs import get_codec
from model.checkpoint import model_fingerprint
from model.inference import InferenceSession
from model.replay import ReplayPass, replay
from model.train import DEFAULT_SPLIT_DATE, date_to_ms


def codec_spec(text: str) -> str:
    try:
        return get_codec(text).spec
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def stored_bytes_per_token(cache: KVCacheManager, users: np.ndarray) -> float:
    """Host-tier bytes over the tokens its entries hold (the replayed users all fit in it)."""
    host = cache.host_storage
    tokens = sum(e.length for e in (host.info(int(u)) for u in users) if e is not None)
    return host.bytes_used / tokens if tokens else float("nan")


def run_codec(args, model, dataset, spec, batches, warmup, pages_needed, largest) -> tuple[ReplayPass, float, dict]:
    fingerprint = model_fingerprint(model)
    config = dataclasses.replace(cache_config(args, model, pages_needed, largest, model.config.page_size, fingerprint),
                                 kv_codec=spec)
    with KVCacheManager(config) as cache:
        session = InferenceSession(model, dataset, kv_cache=cache, model_fingerprint=fingerprint)
        replay(session, warmup, f"warm-up {spec}", progress=False)
        result = replay(session, batches, spec, progress=False)
        cache.offload_kv_cache()
        users = np.unique(dataset.requests.user_id[np.concatenate(batches)])
        return result, stored_bytes_per_token(cache, users), dataclasses.asdict(cache.stats())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--codecs", nargs="+", type=codec_spec, default=["raw", "zstd", "bf16", "int8", "mixed"])
    p.add_argument("--from_date", type=int, default=DEFAULT_SPLIT_DATE)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_requests", type=int, default=None)
    p.add_argument("--output", default="kv_codecs.json")
    args = p.parse_args(argv)
    # the fields cache_config reads, as inference_end2end_example.py defaults them
    args.kv_pages, args.host_capacity, args.async_offload, args.kv_tier = None, None, False, "memory"
    args.device, args.dtype, args.seed, args.preset = "cpu", "float32", 0, "demo"
    dataset = InferenceDataset(args.data_dir)
    model = load_model(args, dataset)
    from_ms = date_to_ms(args.from_date)
    indices = dataset.request_indices(from_time_ms=from_ms, max_requests=args.max_requests)
    batches = list(dataset.batches(indices, args.batch_size))
    warmup = warmup_batches(dataset, indices, from_ms, args.batch_size)
    pages_needed, largest = working_set_pages(model, dataset, indices, model.config.page_size)
    full = replay(InferenceSession(model, dataset), batches, "full recompute", progress=False)
    full_auc = full.auc(TASKS)
    specs = ["raw", *[s for s in args.codecs if s != "raw"]]
    rows, reference = {}, None
    for spec in specs:
        result, per_token, stats = run_codec(args, model, dataset, spec, batches, warmup, pages_needed, largest)
        reference = reference or result
        diff = np.abs(result.logits - reference.logits)
        auc = result.auc(TASKS)
        rows[spec] = {
            "max_abs_logit_diff_vs_raw": float(diff.max()), "mean_abs_logit_diff_vs_raw": float(diff.mean()),
            "max_abs_logit_diff_vs_full": float(np.abs(result.logits - full.logits).max()),
            "auc": auc, "delta_auc_vs_full": {t: None if auc[t] is None else auc[t] - full_auc[t] for t in TASKS},
            "bytes_per_token": per_token, "onloaded_bytes": stats["onloaded_bytes"],
            "tokens_reused": result.tokens_reused, "seconds": result.seconds,
        }
    raw_bpt = rows["raw"]["bytes_per_token"]
    for row in rows.values():
        row["bytes_ratio_vs_raw"] = raw_bpt / row["bytes_per_token"]
    report = {"data_dir": args.data_dir, "checkpoint": args.checkpoint, "num_requests": full.num_requests,
              "full_recompute_auc": full_auc, "codecs": rows}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(f"{'codec':<48} {'B/token':>8} {'ratio':>6} {'max|dlogit|':>11} {'mean|dlogit|':>12} {'max|dAUC|':>9}")
    for spec, r in rows.items():
        worst = max((abs(v) for v in r["delta_auc_vs_full"].values() if v is not None), default=float("nan"))
        print(f"{spec:<48} {r['bytes_per_token']:>8.0f} {r['bytes_ratio_vs_raw']:>6.2f} "
              f"{r['max_abs_logit_diff_vs_raw']:>11.3g} {r['mean_abs_logit_diff_vs_raw']:>12.3g} {worst:>9.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
