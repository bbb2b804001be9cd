"""The ranking model against baselines: same split, same requests, same metric (per-task AUC).

    python benchmark/quality_benchmark.py --data_dir artifacts/synthetic/processed \\
        --checkpoint artifacts/synthetic/checkpoint --output artifacts/synthetic/quality.json

Scores every visit from --split_date on with the HSTU model (a --checkpoint, or one trained
here when the checkpoint directory has none, or with --retrain) and with item popularity, a
user-kNN collaborative filter and matrix factorisation fitted on the events before the split
date (model/quality.py). Prints the per-task AUC table, the training throughput when it
trained, and whether the model beats the best baseline's click AUC; writes the same to JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

from data.dataset import InferenceDataset
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import PRESET_NAMES
from model.evaluation import score_requests
from model.quality import compare, quality_split
from model.train import TrainParams, date_to_ms, train

MODEL = "HSTU"
CLICK_MARGIN_TARGET = 0.02  # the model's click AUC must exceed the best baseline's by this much


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainParams()
    p.add_argument("--data_dir", required=True, help="preprocessor_inference.py output directory")
    p.add_argument("--checkpoint", help="model.train output; trained here (and saved there) when it holds none")
    p.add_argument("--retrain", action="store_true", help="train even if --checkpoint holds a model")
    p.add_argument("--preset", default=d.preset, choices=PRESET_NAMES)
    p.add_argument("--split_date", type=int, default=d.split_date, help="YYYYMMDD: train before, evaluate from")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max_train_seconds", type=float, default=None)
    p.add_argument("--max_eval_requests", type=int, default=None, help="evaluate only the first N visits")
    p.add_argument("--batch_size", type=int, default=8, help="scoring batch size")
    p.add_argument("--full_recompute", action="store_true",
                   help="score by full recompute of every window instead of through the KV cache (same logits)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--output", type=Path, help="JSON results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args(argv)
    try:
        # Video counters frozen at the split: like the baselines, the model reads no other user's
        # event from the evaluation period (only each user's own history, as serving does).
        dataset = InferenceDataset(args.data_dir, video_counters_until_ms=date_to_ms(args.split_date))
        split = quality_split(dataset, args.split_date, max_eval_requests=args.max_eval_requests)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    has_checkpoint = args.checkpoint is not None and (Path(args.checkpoint) / "model.pt").is_file()
    training = None
    if has_checkpoint and not args.retrain:
        model = load_checkpoint(args.checkpoint).model.eval()
    else:
        params = TrainParams(preset=args.preset, split_date=args.split_date, epochs=args.epochs,
                             max_train_seconds=args.max_train_seconds, seed=args.seed)
        model, training = train(dataset, params)
        if args.checkpoint is not None:
            save_checkpoint(model, args.checkpoint, metadata={"train": asdict(training), "params": asdict(params)})
    started = time.perf_counter()
    scored = score_requests(model, dataset, split.eval_requests, args.batch_size, desc="score (HSTU)",
                            kv_cache=not args.full_recompute)
    scoring_seconds = time.perf_counter() - started
    table = compare(split, {MODEL: scored.logits}, seed=args.seed)
    best_name, best_auc = table.best_baseline("click")
    margin = table.margin(MODEL, "click")

    print(f"\nper-task AUC on {table.num_requests} visits from {args.split_date} on ({table.num_candidates} candidates)")
    print(table.format())
    print(f"click: {MODEL} {table.auc[MODEL]['click']:.4f} vs best baseline ({best_name}) {best_auc:.4f}: "
          f"margin {margin:+.4f} (target >= +{CLICK_MARGIN_TARGET}) -> "
          f"{'pass' if margin >= CLICK_MARGIN_TARGET else 'FAIL'}")
    popularity_margin = table.auc[MODEL]["click"] - table.auc["item popularity"]["click"]
    print(f"click: {MODEL} vs item popularity: {popularity_margin:+.4f} -> {'beats' if popularity_margin > 0 else 'LOSES TO'} it")
    if training is not None:
        print(f"training: {training.steps} steps, best epoch {training.best_epoch} of {len(training.epochs)}, "
              f"{training.candidates_per_second:.0f} candidates/s ({training.requests_per_second:.1f} visits/s), "
              f"{training.seconds:.0f} s")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "auc": table.auc, "requests": table.num_requests, "candidates": table.num_candidates,
            "click_best_baseline": {"name": best_name, "auc": best_auc}, "click_margin": margin,
            "click_margin_target": CLICK_MARGIN_TARGET, "click_margin_vs_popularity": popularity_margin,
            "scoring_seconds": scoring_seconds, "training": asdict(training) if training is not None else None,
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
