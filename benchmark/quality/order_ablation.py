"""Does a checkpoint read the history it is served? The order ablation (model/order_ablation.py).

    python -m benchmark.quality.order_ablation --data_dir artifacts/synthetic/processed \\
        --checkpoint artifacts/synthetic/checkpoint --output artifacts/synthetic/order_ablation.json

Scores the visits from --split_date on (benchmark/quality/against_baselines.py's evaluated visits, video counters
frozen at the split as there) with each visit's history as logged, shuffled within its window,
cut to its last K events (--last_k) and removed, and prints per variant the click and long_view
AUC, the change of click AUC against the logged history with a 95% interval from a paired
bootstrap over the users (--resamples), and the mean |Δ click logit| against the logged history,
also in units of the logged logits' spread. Exit 0; the JSON has every figure.
"""
from __future__ import annotations

import argparse
import sys

from benchmark.cli import add_checkpoint, add_data_dir, add_output, add_seed
from benchmark.report import write_json
from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, beijing_midnight_ms
from model.checkpoint import load_checkpoint
from model.order_ablation import format_ablation, order_ablation


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p)
    add_checkpoint(p, required=True)
    p.add_argument("--split_date", type=int, default=DEFAULT_SPLIT_DATE, help="YYYYMMDD: score the visits from it on")
    p.add_argument("--last_k", type=int, nargs="+", default=[0, 1, 16], help="window cuts to score (0: no event)")
    p.add_argument("--no_shuffle", action="store_true",
                   help="skip the shuffled history (a data set without order: a full pass saved)")
    p.add_argument("--max_requests", type=int, default=None, help="score only the first N visits")
    p.add_argument("--batch_size", type=int, default=8)
    add_seed(p, help="of the shuffles and the bootstrap")
    p.add_argument("--resamples", type=int, default=1000, help="user resamples of the click AUC changes' intervals")
    p.add_argument("--attention_window", type=int, default=None,
                   help="serve the checkpoint through this sliding attention window, 0 = the whole window "
                        "(default: its own)")
    add_output(p)
    args = p.parse_args(argv)
    if args.resamples < 1:
        p.error(f"--resamples must be >= 1, got {args.resamples}")
    if any(k < 0 for k in args.last_k):
        p.error(f"--last_k must be >= 0, got {args.last_k}")
    if args.attention_window is not None and args.attention_window < 0:
        p.error(f"--attention_window must be >= 0 (0 = the whole window), got {args.attention_window}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        dataset = InferenceDataset(args.data_dir, video_counters_until_ms=beijing_midnight_ms(args.split_date))
        model = load_checkpoint(args.checkpoint, attention_window=args.attention_window).model.eval()
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    indices = dataset.request_indices(from_time_ms=beijing_midnight_ms(args.split_date), max_requests=args.max_requests)
    if len(indices) == 0:
        print(f"error: no visits on or after {args.split_date} in {args.data_dir}", file=sys.stderr)
        return 2
    result = order_ablation(model, dataset, indices, args.batch_size, tuple(args.last_k), args.seed,
                            resamples=args.resamples, shuffle=not args.no_shuffle)
    print(format_ablation(result))
    write_json(args.output, result.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
