"""Can a model shape learn to read order, and at which learning rate? (model/order_task.py)

    python benchmark/order_learning.py --presets tiny demo --learning_rates 2e-3 2.5e-4 1e-4 \
        --steps 300 --output order_learning.json

For every (preset, learning rate) a fresh model is trained on the order task (fresh users every
step, so nothing can be memorised) and scored every `--eval_every` steps on the same held-out
users, as logged and with their histories shuffled. A model that reads order has a high AUC as
logged and ~0.5 shuffled; the first step at which the logged AUC reaches `--learnt_auc` is the
length of its plateau. Prints a table, writes JSON (and a PNG of AUC against steps with --plot).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from tqdm import tqdm

from model.config import PRESET_NAMES, preset
from model.order_task import RULES, OrderTask, learn_order


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "demo"], choices=PRESET_NAMES)
    p.add_argument("--learning_rates", nargs="+", type=float, default=[2e-3, 2.5e-4, 1e-4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--rule", choices=RULES, default="last_event")
    p.add_argument("--num_tags", type=int, default=8)
    p.add_argument("--history", type=int, default=64)
    p.add_argument("--learnt_auc", type=float, default=0.75, help="the AUC at which a run counts as having learnt")
    p.add_argument("--override", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="HSTUConfig fields replaced in every preset (e.g. hidden_dim=256 video_hash_size=200003)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON file")
    p.add_argument("--plot", default=None, help="PNG file: click AUC against steps, one line per run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    overrides = _overrides(args.override)
    task = OrderTask(num_tags=args.num_tags, history=args.history, rule=args.rule, seed=args.seed)
    runs = []
    grid = [(name, lr) for name in args.presets for lr in args.learning_rates]
    for name, lr in tqdm(grid, desc="order learning", file=sys.stderr):
        started = time.perf_counter()
        progress = learn_order(task, preset(name, **overrides), args.steps, lr, eval_every=args.eval_every,
                               seed=args.seed)
        learnt = next((p.step for p in progress if p.auc >= args.learnt_auc), None)
        runs.append({"preset": name, "learning_rate": lr, "seconds": time.perf_counter() - started,
                     "learnt_at_step": learnt, "progress": [asdict(p) for p in progress]})
    print(f"order task: rule {task.rule}, {task.num_tags} tags, {task.history} events, {args.steps} steps, "
          f"seed {args.seed}, overrides {overrides or 'none'}; AUC as logged / shuffled, |Δ logit| / std when shuffled")
    print(f"{'preset':8} {'lr':>8} {'final AUC':>10} {'shuffled':>9} {'|Δ|/std':>8} {'learnt at':>10} {'seconds':>8}")
    for run in runs:
        last = run["progress"][-1]
        learnt = run["learnt_at_step"] if run["learnt_at_step"] is not None else "never"
        print(f"{run['preset']:8} {run['learning_rate']:8.1e} {last['auc']:10.3f} {last['shuffled_auc']:9.3f} "
              f"{last['shuffled_change']:8.3f} {learnt!s:>10} {run['seconds']:8.0f}")
    report = {"task": asdict(task), "steps": args.steps, "learnt_auc": args.learnt_auc, "overrides": overrides,
              "runs": runs}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        _plot(runs, args.plot)
    return 0


def _overrides(items: list[str]) -> dict[str, object]:
    """FIELD=VALUE strings -> HSTUConfig fields, each value parsed as the field's type."""
    defaults = preset("tiny")
    out: dict[str, object] = {}
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or not hasattr(defaults, field):
            raise SystemExit(f"--override {item!r}: expected FIELD=VALUE with an HSTUConfig field")
        out[field] = type(getattr(defaults, field))(value)
    return out


def _plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        steps = [p["step"] for p in run["progress"]]
        ax.plot(steps, [p["auc"] for p in run["progress"]], marker="o",
                label=f"{run['preset']}, lr {run['learning_rate']:.1e}")
    ax.axhline(0.5, color="grey", lw=0.5)
    ax.set_xlabel("training steps")
    ax.set_ylabel("held-out click AUC (as logged)")
    ax.set_title("Learning an order rule over tags")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
