"""The ranking model against baselines: same split, same requests, same metric (per-task AUC).

    python benchmark/quality_benchmark.py --data_dir artifacts/synthetic/processed \\
        --checkpoint artifacts/synthetic/checkpoint --output artifacts/synthetic/quality.json

Scores every visit from --split_date on with the HSTU model (a --checkpoint, or one trained
here when the checkpoint directory has none, or with --retrain) and with item popularity, a
user-kNN collaborative filter and matrix factorisation fitted on the events before the split
date (model/quality.py). Prints the per-task AUC table, the training throughput when it
trained, and whether the model beats the best baseline's click AUC; writes the same to JSON.

With `--seeds 0 1 2` it does all of that once per seed (the trainer and matrix factorisation
reseeded alike) and reports the smallest margin: the target holds only if it holds for every seed.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from data.dataset import InferenceDataset
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import PRESET_NAMES
from model.evaluation import score_requests
from model.quality import QualitySplit, QualityTable, compare, quality_split
from model.train import TrainParams, TrainReport, date_to_ms, train

MODEL = "HSTU"
CLICK_MARGIN_TARGET = 0.02  # the model's click AUC must exceed the best baseline's by this much


@dataclass(frozen=True)
class SeedRun:
    """One seed's model (trained with it, or the checkpoint's) and baselines (fitted with it), scored."""

    seed: int
    table: QualityTable
    training: TrainReport | None
    scoring_seconds: float

    @property
    def click_margin(self) -> float:
        return self.table.margin(MODEL, "click")

    @property
    def click_margin_vs_popularity(self) -> float:
        return self.table.auc[MODEL]["click"] - self.table.auc["item popularity"]["click"]

    def to_json(self) -> dict:
        best_name, best_auc = self.table.best_baseline("click")
        return {
            "seed": self.seed, "auc": self.table.auc, "requests": self.table.num_requests,
            "candidates": self.table.num_candidates, "click_best_baseline": {"name": best_name, "auc": best_auc},
            "click_margin": self.click_margin,
            "click_margin_vs_popularity": self.click_margin_vs_popularity,
            "scoring_seconds": self.scoring_seconds,
            "training": asdict(self.training) if self.training is not None else None,
        }


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
    p.add_argument("--seeds", "--seed", type=int, nargs="+", default=[d.seed],
                   help="one run per seed (the trainer and matrix factorisation reseeded alike); several seeds "
                        "train one model each (saved under CHECKPOINT/seed_N) and the target must hold for all")
    p.add_argument("--output", type=Path, help="JSON results")
    args = p.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds repeats a seed: {args.seeds}")
    return args


def run_seed(args: argparse.Namespace, dataset: InferenceDataset, split: QualitySplit, seed: int) -> SeedRun:
    """Train (or load) the model, score the evaluation visits, fit and score the baselines, all with `seed`."""
    checkpoint = args.checkpoint
    if checkpoint is not None and len(args.seeds) > 1:
        checkpoint = str(Path(checkpoint) / f"seed_{seed}")
    training = None
    if checkpoint is not None and (Path(checkpoint) / "model.pt").is_file() and not args.retrain:
        model = load_checkpoint(checkpoint).model.eval()
    else:
        params = TrainParams(preset=args.preset, split_date=args.split_date, epochs=args.epochs,
                             max_train_seconds=args.max_train_seconds, seed=seed)
        model, training = train(dataset, params)
        if checkpoint is not None:
            save_checkpoint(model, checkpoint, metadata={"train": asdict(training), "params": asdict(params)})
    started = time.perf_counter()
    scored = score_requests(model, dataset, split.eval_requests, args.batch_size, desc=f"score (HSTU, seed {seed})",
                            kv_cache=not args.full_recompute)
    scoring_seconds = time.perf_counter() - started
    return SeedRun(seed, compare(split, {MODEL: scored.logits}, seed=seed), training, scoring_seconds)


def _verdict(margin: float) -> str:
    return "pass" if margin >= CLICK_MARGIN_TARGET else "FAIL"


def _print_run(run: SeedRun, split_date: int) -> None:
    table = run.table
    best_name, best_auc = table.best_baseline("click")
    print(f"\nseed {run.seed}: per-task AUC on {table.num_requests} visits from {split_date} on "
          f"({table.num_candidates} candidates)")
    print(table.format())
    print(f"click: {MODEL} {table.auc[MODEL]['click']:.4f} vs best baseline ({best_name}) {best_auc:.4f}: "
          f"margin {run.click_margin:+.4f} (target >= +{CLICK_MARGIN_TARGET}) -> {_verdict(run.click_margin)}")
    margin = run.click_margin_vs_popularity
    print(f"click: {MODEL} vs item popularity: {margin:+.4f} -> {'beats' if margin > 0 else 'LOSES TO'} it")
    if run.training is not None:
        t = run.training
        print(f"training: {t.steps} steps, best epoch {t.best_epoch} of {len(t.epochs)}, "
              f"{t.candidates_per_second:.0f} candidates/s ({t.requests_per_second:.1f} visits/s), {t.seconds:.0f} s")


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
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(args, dataset, split, seed))
        _print_run(runs[-1], args.split_date)
    margins = [run.click_margin for run in runs]
    if len(runs) > 1:
        print(f"\nclick margin over {len(runs)} seeds: min {min(margins):+.4f}, mean {sum(margins) / len(margins):+.4f}, "
              f"max {max(margins):+.4f}; {sum(m >= CLICK_MARGIN_TARGET for m in margins)} of {len(runs)} pass "
              f"-> {_verdict(min(margins))}")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "seeds": [run.to_json() for run in runs], "click_margin_target": CLICK_MARGIN_TARGET,
            "click_margin_min": min(margins), "click_margin_mean": sum(margins) / len(margins),
            "passes": sum(m >= CLICK_MARGIN_TARGET for m in margins),
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
