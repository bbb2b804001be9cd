"""The ranking model against baselines: same split, same requests, same metric (per-task AUC).

    python -m benchmark.quality.against_baselines --data_dir artifacts/synthetic/processed \\
        --checkpoint artifacts/synthetic/checkpoint --output artifacts/synthetic/quality.json

Scores every visit from --split_date on with the HSTU model (a --checkpoint, or one trained
here when the checkpoint directory has none, or with --retrain) and with every baseline of
model/baselines/registry.py: item popularity, user-kNN, matrix factorisation, ALS, BPR, item-kNN,
a last-items Markov model and SASRec, each tuned on the holdout's click AUC and fitted on the
training period (model/quality.py). Prints the per-task AUC table, what each baseline's tuning
picked, the training throughput when it trained, and whether the model beats the best baseline's
click AUC, with a 95% interval of that margin from a paired bootstrap over the evaluated users
(model/auc_interval.py); writes the same to JSON. `--baselines` limits the set (by name); `--baselines_only`
fits and scores the baselines alone (no model, no checkpoint).

With `--seeds 0 1 2` it does all of that once per seed (the trainer and the seeded baselines
reseeded alike) and reports the smallest margin: the target holds only if it holds for every seed.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmark.cli import add_checkpoint, add_data_dir, add_output
from benchmark.report import write_json
from data.dataset import InferenceDataset
from data.schema import beijing_midnight_ms
from model.auc_interval import PairedInterval
from model.baselines import ItemPopularity
from model.baselines.registry import BASELINES, QUICK_BASELINES
from model.baselines.tuning import Baseline
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import PRESET_NAMES
from model.evaluation import score_requests
from model.quality import QualitySplit, QualityTable, compare, quality_split
from model.train import train
from model.train_arguments import add_recipe_arguments, parse_recipe_arguments, recipe_params
from model.train_params import TrainParams, TrainReport
from model.video_tags import VideoTagTable

MODEL = "HSTU"
CLICK_MARGIN_TARGET = 0.02  # the model's click AUC must exceed the best baseline's by this much


@dataclass(frozen=True)
class SeedRun:
    """One seed's model (trained with it, or the checkpoint's; none with --baselines_only) and baselines
    (fitted with it), scored. The margins are None without a model."""

    seed: int
    table: QualityTable
    training: TrainReport | None
    scoring_seconds: float | None

    @property
    def has_model(self) -> bool:
        return MODEL in self.table.auc

    @property
    def click_margin(self) -> float | None:
        return self.table.margin(MODEL, "click") if self.has_model else None

    @property
    def click_margin_interval(self) -> PairedInterval | None:
        """The click margin with its paired bootstrap interval over the evaluated users."""
        return self.table.click_margin_intervals.get(MODEL)

    @property
    def click_margin_vs_popularity(self) -> float | None:
        """None also when item popularity was left out (--baselines)."""
        if not self.has_model or ItemPopularity.name not in self.table.auc:
            return None
        return self.table.auc[MODEL]["click"] - self.table.auc[ItemPopularity.name]["click"]

    def to_json(self) -> dict:
        best_name, best_auc = self.table.best_baseline("click")
        return {
            "seed": self.seed, "auc": self.table.auc, "requests": self.table.num_requests,
            "candidates": self.table.num_candidates, "click_best_baseline": {"name": best_name, "auc": best_auc},
            "click_margin": self.click_margin,
            "click_margin_interval": None if self.click_margin_interval is None else self.click_margin_interval.to_json(),
            "click_margin_vs_popularity": self.click_margin_vs_popularity,
            "scoring_seconds": self.scoring_seconds,
            "training": asdict(self.training) if self.training is not None else None,
            "baselines": self.table.baselines,
        }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = TrainParams()
    add_data_dir(p)
    add_checkpoint(p, help="model.train output; trained here (and saved there) when it holds none")
    p.add_argument("--retrain", action="store_true", help="train even if --checkpoint holds a model")
    p.add_argument("--preset", default=d.preset, choices=PRESET_NAMES)
    p.add_argument("--split_date", type=int, default=d.split_date, help="YYYYMMDD: train before, evaluate from")
    add_recipe_arguments(p)
    p.add_argument("--max_eval_requests", type=int, default=None, help="evaluate only the first N visits")
    p.add_argument("--batch_size", type=int, default=8, help="scoring batch size")
    p.add_argument("--full_recompute", action="store_true",
                   help="score by full recompute of every window instead of through the KV cache (same logits)")
    p.add_argument("--seeds", "--seed", type=int, nargs="+", default=[d.seed],
                   help="one run per seed (the trainer and the seeded baselines reseeded alike); several seeds "
                        "train one model each (saved under CHECKPOINT/seed_N) and the target must hold for all")
    names = [b.name for b in BASELINES]
    p.add_argument("--baselines", nargs="+", default=names, metavar="NAME",
                   help=f"the baselines to fit (default: all): {', '.join(repr(n) for n in names)}")
    p.add_argument("--baselines_only", action="store_true", help="fit and score the baselines alone (no model)")
    p.add_argument("--quick", action="store_true",
                   help="one grid point per baseline (model/baselines/registry.py QUICK_BASELINES): make demo's budget")
    p.add_argument("--resamples", type=int, default=1000,
                   help="user resamples of the paired bootstrap interval of the click margin")
    add_output(p)
    args = parse_recipe_arguments(p, argv)
    if args.resamples < 1:
        p.error(f"--resamples must be >= 1, got {args.resamples}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds repeats a seed: {args.seeds}")
    unknown = [name for name in args.baselines if name not in names]
    if unknown:
        p.error(f"--baselines: unknown baseline {unknown[0]!r}; choose from {', '.join(repr(n) for n in names)}")
    return args


def chosen_baselines(names: list[str], quick: bool = False) -> tuple[Baseline, ...]:
    return tuple(b for b in (QUICK_BASELINES if quick else BASELINES) if b.name in names)


def run_seed(args: argparse.Namespace, dataset: InferenceDataset, split: QualitySplit, seed: int) -> SeedRun:
    """Train (or load) the model, score the evaluation visits, fit and score the baselines, all with `seed`."""
    baselines = chosen_baselines(args.baselines, args.quick)
    if args.baselines_only:
        return SeedRun(seed, compare(split, {}, seed=seed, baselines=baselines, resamples=args.resamples), None, None)
    checkpoint = args.checkpoint
    if checkpoint is not None and len(args.seeds) > 1:
        checkpoint = str(Path(checkpoint) / f"seed_{seed}")
    training = None
    if checkpoint is not None and (Path(checkpoint) / "model.pt").is_file() and not args.retrain:
        model = load_checkpoint(checkpoint, attention_window=args.attention_window).model.eval()
    else:
        params = recipe_params(args, preset=args.preset, split_date=args.split_date, seed=seed)
        model, training = train(dataset, params)
        if checkpoint is not None:
            save_checkpoint(model, checkpoint, metadata={"train": asdict(training), "params": asdict(params)})
    started = time.perf_counter()
    scored = score_requests(model, dataset, split.eval_requests, args.batch_size, desc=f"score (HSTU, seed {seed})",
                            kv_cache=not args.full_recompute)
    scoring_seconds = time.perf_counter() - started
    table = compare(split, {MODEL: scored.logits}, seed=seed, baselines=baselines, resamples=args.resamples)
    return SeedRun(seed, table, training, scoring_seconds)


def _verdict(margin: float) -> str:
    return "pass" if margin >= CLICK_MARGIN_TARGET else "FAIL"


def _print_run(run: SeedRun, split_date: int) -> None:
    table = run.table
    best_name, best_auc = table.best_baseline("click")
    print(f"\nseed {run.seed}: per-task AUC on {table.num_requests} visits from {split_date} on "
          f"({table.num_candidates} candidates)")
    print(table.format())
    for name, pick in table.baselines.items():
        print(f"  {name}: holdout click AUC {pick['holdout_click_auc']:.4f} of {pick['grid_points']} grid points with "
              f"{pick['params'] or 'no parameters'}")
    if not run.has_model:
        print(f"click: best baseline ({best_name}) {best_auc:.4f}")
        return
    print(f"click: {MODEL} {table.auc[MODEL]['click']:.4f} vs best baseline ({best_name}) {best_auc:.4f}: "
          f"margin {run.click_margin_interval.format()} (target >= +{CLICK_MARGIN_TARGET}) -> "
          f"{_verdict(run.click_margin)}")
    margin = run.click_margin_vs_popularity
    if margin is not None:
        print(f"click: {MODEL} vs item popularity: {margin:+.4f} -> {'beats' if margin > 0 else 'LOSES TO'} it")
    if run.training is not None:
        t = run.training
        print(f"training: {t.steps} steps, best epoch {t.best_epoch} of {len(t.epochs)}, "
              f"{t.candidates_per_second:.0f} candidates/s ({t.requests_per_second:.1f} visits/s), {t.seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parse_args(argv)
    try:
        if not args.baselines_only:  # a bad recipe is refused before the data is read and the baselines fitted
            recipe_params(args, preset=args.preset, split_date=args.split_date, seed=args.seeds[0])
        # Video counters frozen at the split: like the baselines, the model reads no other user's
        # event from the evaluation period (only each user's own history, as serving does).
        dataset = InferenceDataset(args.data_dir, video_counters_until_ms=beijing_midnight_ms(args.split_date))
        # The sequential baselines read each video's tag wherever the data has tags, whatever the HSTU reads.
        split = quality_split(dataset, args.split_date, max_eval_requests=args.max_eval_requests,
                              video_tags=VideoTagTable.from_dataset_dir(dataset.root))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    runs = []
    for seed in args.seeds:
        runs.append(run_seed(args, dataset, split, seed))
        _print_run(runs[-1], args.split_date)
    summary = _margin_summary(runs)
    if len(runs) > 1 and summary["click_margin_min"] is not None:
        print(f"\nclick margin over {len(runs)} seeds: min {summary['click_margin_min']:+.4f}, mean "
              f"{summary['click_margin_mean']:+.4f}, max {max(run.click_margin for run in runs):+.4f}; "
              f"{summary['passes']} of {len(runs)} pass -> {_verdict(summary['click_margin_min'])}")
        print(f"intervals: above zero on {summary['intervals_above_zero']} of {len(runs)} seeds; the target "
              f"+{CLICK_MARGIN_TARGET} lies inside {summary['intervals_holding_target']} of them")
    write_json(args.output, {"seeds": [run.to_json() for run in runs], **summary})
    return 0


def _margin_summary(runs: list[SeedRun]) -> dict[str, object]:
    """The margins over the seeds (None without a model): the target holds only if it holds for every seed.
    Each seed's interval also says whether its data tell the margin from zero and from the target."""
    with_model = [run for run in runs if run.has_model]
    if not with_model:
        return {"click_margin_target": CLICK_MARGIN_TARGET, "click_margin_min": None, "click_margin_mean": None,
                "passes": None, "intervals_above_zero": None, "intervals_holding_target": None}
    margins = [run.click_margin for run in with_model]
    intervals = [run.click_margin_interval for run in with_model]
    return {"click_margin_target": CLICK_MARGIN_TARGET, "click_margin_min": min(margins),
            "click_margin_mean": sum(margins) / len(margins),
            "passes": sum(m >= CLICK_MARGIN_TARGET for m in margins),
            "intervals_above_zero": sum(i.low > 0 for i in intervals),
            "intervals_holding_target": sum(i.low <= CLICK_MARGIN_TARGET <= i.high for i in intervals)}


if __name__ == "__main__":
    sys.exit(main())
