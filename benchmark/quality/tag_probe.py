"""How much of the click signal do video tags carry, with no learning at all?

    python -m benchmark.quality.tag_probe --data_dir OUT --window 128 --output tag_probe.json

For every candidate of the visits from `--split_date` on, two counts over the user's last
`--window` events before the visit (data with `video_tags.parquet`, model/video_tags.py):

    same-tag events     how many share the candidate's primary tag
    same-tag click rate (clicks + 1) / (events + 2) among those

and the click AUC of each as a score, beside the user's own click rate over the same events. A
sequence model that reads tags could learn either; docs/model.md ("Video tags") compares the HSTU
with them. Prints a table, writes JSON.

    python -m benchmark.quality.tag_probe --data_dir OUT --checkpoint CKPT --baselines "matrix factorisation"

also scores benchmark/quality/against_baselines.py's evaluated candidates with the checkpoint and the named baselines,
and stacks each one's click score with the tag counts of the last `--stack_windows` events (the log
share of the window's events with the candidate's tag, the log ratio of the same-tag click rate to
the user's own) in a logistic regression, each half of the users scored by the fit on the other.
The gain in click AUC, with a paired bootstrap interval over users, is what the history's tags
hold that the scorer does not read.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from benchmark.cli import add_checkpoint, add_data_dir, add_output
from benchmark.report import write_json
from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, TASKS, beijing_midnight_ms
from model.auc_interval import paired_auc_difference
from model.baselines.affinity import logistic_fit
from model.baselines.registry import BASELINES
from model.checkpoint import load_checkpoint
from model.evaluation import score_requests
from model.metrics import auc
from model.quality import QualitySplit, fit_baselines, quality_split
from model.video_tags import VideoTagTable

CLICK_BIT = 1


@dataclass(frozen=True)
class TagCounts:
    """Per candidate [M], over the user's last `window` events before its visit."""

    same_tag: np.ndarray  # events sharing the candidate's primary tag
    same_tag_clicks: np.ndarray  # clicked ones among them
    events: np.ndarray  # events in the window
    clicks: np.ndarray  # clicked events in the window
    labels: np.ndarray  # bool: the candidate was clicked

    def features(self) -> np.ndarray:
        """[M, 2]: the log share of the window's events with the candidate's tag (the user's exposure to
        it: the feed follows taste), and the log ratio of the same-tag click rate to the user's own."""
        share = np.log((self.same_tag + 1) / (self.events + 1))
        rate = np.log((self.same_tag_clicks + 1) / (self.same_tag + 2)) - np.log((self.clicks + 1) / (self.events + 2))
        return np.stack([share, rate], 1)


def tag_counts(dataset: InferenceDataset, tags: VideoTagTable, indices: np.ndarray, window: int) -> TagCounts:
    """The counts of the candidates of requests `indices`, in request order."""
    events, requests = dataset.event_arrays(), dataset.requests
    rows = dataset.user_rows(requests.user_id[indices])
    parts: list[list[np.ndarray]] = [[], [], [], [], []]
    for i, row in tqdm(zip(indices, rows), total=len(indices), desc=f"tag counts (last {window})", file=sys.stderr):
        base, end, m = events.offsets[row], requests.end[i], requests.num_candidates[i]
        seen = slice(base + max(0, end - window), base + end)
        history_tags = tags.rows(events.video_ids[seen])
        clicks = (events.action_weights[seen] & CLICK_BIT) > 0
        candidate_tags = tags.rows(events.video_ids[base + end: base + end + m])
        match = candidate_tags[:, None] == history_tags[None, :]  # [m, window]
        for out, value in zip(parts, (match.sum(1), (match & clicks[None, :]).sum(1), np.full(m, len(clicks)),
                                      np.full(m, clicks.sum()),
                                      (events.action_weights[base + end: base + end + m] & CLICK_BIT) > 0)):
            out.append(value)
    return TagCounts(*(np.concatenate(part) for part in parts))


def probe(dataset: InferenceDataset, tags: VideoTagTable, window: int, split_date: int,
          max_requests: int | None = None) -> dict[str, float]:
    requests = dataset.requests
    chosen = np.flatnonzero(requests.time_ms >= beijing_midnight_ms(split_date))[:max_requests]
    counts = tag_counts(dataset, tags, chosen, window)
    y = counts.labels
    return {"candidates": len(y), "visits": len(chosen),
            "same_tag_events": auc(counts.same_tag.astype(float), y),
            "same_tag_click_rate": auc((counts.same_tag_clicks + 1) / (counts.same_tag + 2), y),
            "user_click_rate": auc(np.where(counts.events > 0, counts.clicks / np.maximum(counts.events, 1), 0.0), y)}


def cross_fitted_stack(scores: np.ndarray, features: np.ndarray, labels: np.ndarray, users: np.ndarray) -> np.ndarray:
    """[M] a logistic regression of the labels on (scores, features), each half of the users scored by
    the fit on the other half: what the features add to the scores, with no user's labels used on it."""
    design = np.column_stack([scores, features])
    stacked = np.zeros(len(scores))
    fold = users % 2 == 0
    for train_on in (fold, ~fold):
        w = logistic_fit(design[train_on], labels[train_on].astype(np.float64))
        stacked[~train_on] = design[~train_on] @ w[:-1] + w[-1]
    return stacked


def stacked_report(split: QualitySplit, counts: dict[int, TagCounts], scorers: dict[str, np.ndarray],
                   resamples: int) -> dict[str, dict[str, object]]:
    """Per scorer: its click AUC, and per window what the tag counts add to it (cross-fitted), with
    a paired bootstrap interval over the users."""
    labels, users = split.eval_pairs.labels[:, TASKS.index("click")] > 0.5, split.eval_pairs.user_ids
    report = {}
    for name, scores in scorers.items():
        gains = {}
        for window, c in counts.items():
            stacked = cross_fitted_stack(scores, c.features(), labels, users)
            gains[window] = paired_auc_difference(stacked, scores, labels, users, resamples=resamples).to_json()
        report[name] = {"click_auc": auc(scores, labels), "gain_with_tag_counts": gains}
    return report


def _stack(args: argparse.Namespace, dataset: InferenceDataset, tags: VideoTagTable) -> dict[str, dict[str, object]]:
    """The HSTU's (--checkpoint) and the named baselines' click scores of benchmark/quality/against_baselines.py's evaluated
    candidates, and what the tag counts add to each."""
    split = quality_split(dataset, args.split_date, max_eval_requests=args.max_requests, video_tags=tags)
    scorers = {}
    if args.checkpoint:
        model = load_checkpoint(args.checkpoint).model.eval()
        logits = score_requests(model, dataset, split.eval_requests, 8, desc="score (HSTU)", kv_cache=True).logits
        scorers["HSTU"] = logits[:, TASKS.index("click")]
    chosen = tuple(b for b in BASELINES if b.name in args.baselines)
    for name, run in fit_baselines(split, baselines=chosen).items():
        scorers[name] = run.scores[:, TASKS.index("click")]
    counts = {window: tag_counts(dataset, tags, split.eval_requests, window) for window in args.stack_windows}
    return stacked_report(split, counts, scorers, args.resamples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_dir(p, help="preprocessor_inference.py output with video_tags.parquet")
    p.add_argument("--window", type=int, default=128, help="events before each visit the counts read")
    p.add_argument("--split_date", type=int, default=DEFAULT_SPLIT_DATE, help="YYYYMMDD: the visits scored")
    p.add_argument("--max_requests", type=int, default=None)
    add_checkpoint(p, help="model.train output: stack the tag counts on its click logits")
    names = [b.name for b in BASELINES]
    p.add_argument("--baselines", nargs="*", default=[], metavar="NAME",
                   help=f"baselines to stack the tag counts on (fitted as benchmark/quality/against_baselines.py fits them): "
                        f"{', '.join(repr(n) for n in names)}")
    p.add_argument("--stack_windows", type=int, nargs="+", default=[128, 1024],
                   help="the windows (events before each visit) whose tag counts are stacked")
    p.add_argument("--resamples", type=int, default=1000, help="user resamples of the gains' intervals")
    add_output(p)
    args = p.parse_args(argv)
    unknown = [name for name in args.baselines if name not in names]
    if unknown:
        p.error(f"--baselines: unknown baseline {unknown[0]!r}; choose from {', '.join(repr(n) for n in names)}")
    if min(args.window, *args.stack_windows) < 1 or args.resamples < 1:
        p.error("--window, --stack_windows and --resamples must be >= 1")
    dataset = InferenceDataset(args.data_dir, video_counters_until_ms=beijing_midnight_ms(args.split_date))
    tags = VideoTagTable.from_dataset_dir(dataset.root)
    if tags is None:
        print(f"error: {dataset.root} has no video tags", file=sys.stderr)
        return 2
    result = probe(dataset, tags, args.window, args.split_date, args.max_requests)
    print(f"click AUC over {result['candidates']} candidates of {result['visits']} visits, last {args.window} events:")
    for name in ("same_tag_events", "same_tag_click_rate", "user_click_rate"):
        print(f"  {name:<22}{result[name]:.4f}")
    stacked = _stack(args, dataset, tags) if args.checkpoint or args.baselines else {}
    for name, row in stacked.items():
        print(f"{name}: click AUC {row['click_auc']:.4f}; with the tag counts stacked on it (cross-fitted over users):")
        for window, gain in row["gain_with_tag_counts"].items():
            print(f"  last {window:>5} events  {gain['estimate']:+.4f} "
                  f"(95% over users {gain['low']:+.4f} to {gain['high']:+.4f})")
    write_json(args.output, {"window": args.window, "split_date": args.split_date, **result, "stacked": stacked})
    return 0


if __name__ == "__main__":
    sys.exit(main())
