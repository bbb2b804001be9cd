"""The default trainer on every regime of the generator, against the baselines, with the order ablation
and the data's bounds: one table over catalogue x tags x signal x seed.

    python -m benchmark.quality.regimes --out artifacts/regimes --seeds 0 1 2
    python -m benchmark.quality.regimes --out artifacts/regimes --regimes dense-absent-sequential --seeds 0

For each regime (data/synthetic_regimes.py) and seed it generates the logs (`data.synthetic --regime
--seed`), preprocesses them, and runs, each as its own process, with the seed:
    quality/against_baselines.py  `python -m model.train`'s default model, trained for at most
                                  --max_train_seconds, against the baselines (--baselines)
    quality/order_ablation.py     the same checkpoint with each history shuffled and removed
    quality/bounds.py             what the data allows (the generator's own quantities)
Steps whose output exists are not run again, so an interrupted run resumes. Prints one row per regime
and seed and writes `summary.json` and `summary.png` into --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from benchmark.report import pyplot, save_png, write_json
from data.synthetic_regimes import REGIMES

ROOT = Path(__file__).resolve().parents[2]
MARGIN_TARGET = 0.02
SHUFFLE_TARGET = 0.05  # where order carries the signal, shuffling the history must cost at least this


def _run(args: list[str], log: Path) -> None:
    """One step as a process of its own (its memory is returned when it ends); its output goes to `log`."""
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed (exit {done.returncode}): see {log}")


def run_regime(regime: str, seed: int, args: argparse.Namespace) -> dict:
    """Generate, preprocess, train and score one regime and seed (steps already done are skipped)."""
    home = args.out / regime / f"seed_{seed}"
    raw, processed, checkpoint = home / "raw", home / "processed", home / "checkpoint"
    home.mkdir(parents=True, exist_ok=True)
    steps = [
        (raw / "user_features_1k.csv", ["-m", "data.synthetic", "--out", str(raw), "--scale", str(args.scale),
                                        "--seed", str(seed), "--regime", regime, "--no_progress"]),
        (processed / "manifest.json", ["preprocessor_inference.py", "--dataset_name", "kuairand-1k",
                                       "--data_dir", str(raw), "--output_dir", str(processed)]),
        (home / "quality.json", ["-m", "benchmark.quality.against_baselines", "--data_dir", str(processed),
                                 "--checkpoint", str(checkpoint), "--seeds", str(seed), "--output", str(home / "quality.json"),
                                 "--max_train_seconds", str(args.max_train_seconds),
                                 *(["--baselines", *args.baselines] if args.baselines else []),
                                 *(["--quick"] if args.quick else [])]),
        (home / "ablation.json", ["-m", "benchmark.quality.order_ablation", "--data_dir", str(processed),
                                  "--checkpoint", str(checkpoint), "--last_k", "0", "--seed", str(seed),
                                  "--output", str(home / "ablation.json")]),
        (home / "bounds.json", ["-m", "benchmark.quality.bounds", "--data_dir", str(processed),
                                "--scale", str(args.scale), "--seed", str(seed), "--regime", regime,
                                "--output", str(home / "bounds.json")]),
    ]
    for output, command in steps:
        if not output.exists():
            _run(command, home / f"{output.stem}.log")
    return summarise(regime, seed, home)


def summarise(regime: str, seed: int, home: Path) -> dict:
    """The row of one regime and seed, from its three JSON files."""
    quality = json.loads((home / "quality.json").read_text())["seeds"][0]
    ablation = json.loads((home / "ablation.json").read_text())
    bounds = json.loads((home / "bounds.json").read_text())
    deltas = {name: (variant["click_auc_change"] or {}).get("estimate") for name, variant in ablation["variants"].items()}
    return {
        "regime": regime, "seed": seed, "hstu": quality["auc"]["HSTU"]["click"],
        "best_baseline": quality["click_best_baseline"], "margin": quality["click_margin"],
        "shuffled_delta": deltas.get("shuffled"), "history_free_delta": deltas.get("history-free"),
        "bounds": bounds["auc"], "training_seconds": (quality.get("training") or {}).get("seconds"),
    }


def format_rows(rows: list[dict]) -> str:
    head = f"{'regime':34} {'seed':>4} {'HSTU':>7} {'best baseline':>30} {'margin':>8} {'shuffled':>9} {'no history':>10}"
    lines = [head]
    for r in rows:
        best = f"{r['best_baseline']['name'][:20]} {r['best_baseline']['auc']:.4f}"
        shuffled = "" if r["shuffled_delta"] is None else f"{r['shuffled_delta']:+.4f}"
        free = "" if r["history_free_delta"] is None else f"{r['history_free_delta']:+.4f}"
        lines.append(f"{r['regime']:34} {r['seed']:>4} {r['hstu']:7.4f} {best:>30} {r['margin']:+8.4f} {shuffled:>9} {free:>10}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """HSTU and the best baseline per regime (mean over seeds, each seed a dot)."""
    regimes = list(dict.fromkeys(r["regime"] for r in rows))
    fig, ax = pyplot().subplots(figsize=(max(6, 1.1 * len(regimes)), 4.5))
    for i, regime in enumerate(regimes):
        mine = [r for r in rows if r["regime"] == regime]
        for offset, key, color in ((-0.15, "hstu", "tab:blue"), (0.15, "best", "tab:gray")):
            values = [r["hstu"] if key == "hstu" else r["best_baseline"]["auc"] for r in mine]
            ax.bar(i + offset, sum(values) / len(values), width=0.3, color=color, alpha=0.6,
                   label=("HSTU" if key == "hstu" else "best baseline") if i == 0 else None)
            ax.scatter([i + offset] * len(values), values, color=color, s=10)
    ax.set_xticks(range(len(regimes)), regimes, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("click AUC (evaluated visits)")
    ax.set_ylim(0.45, max(0.8, max(r["hstu"] for r in rows) + 0.02))
    ax.legend()
    save_png(fig, path, dpi=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="one folder per regime and seed, and the summary")
    p.add_argument("--regimes", nargs="+", choices=REGIMES, default=list(REGIMES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="data and training seeds")
    p.add_argument("--scale", type=float, default=0.008, help="data.synthetic --scale (0.008: ~100k events)")
    p.add_argument("--max_train_seconds", type=float, default=600.0)
    p.add_argument("--baselines", nargs="+", default=None, help="benchmark.quality.against_baselines --baselines (default: all)")
    p.add_argument("--quick", action="store_true",
                   help="benchmark.quality.against_baselines --quick: one grid point per baseline instead of its grid")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    for regime, seed in tqdm([(r, s) for r in args.regimes for s in args.seeds], desc="regimes", file=sys.stderr):
        rows.append(run_regime(regime, seed, args))
        tqdm.write(format_rows(rows[-1:]).splitlines()[-1], file=sys.stderr)
    print(format_rows(rows))
    write_json(args.out / "summary.json", {"rows": rows, "margin_target": MARGIN_TARGET, "shuffle_target": SHUFFLE_TARGET})
    plot(rows, args.out / "summary.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
