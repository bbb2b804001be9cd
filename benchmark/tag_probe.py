"""How much of the click signal do video tags carry, with no learning at all?

    python benchmark/tag_probe.py --data_dir OUT --window 128 --output tag_probe.json

For every candidate of the visits from `--split_date` on, two counts over the user's last
`--window` events before the visit (data with `video_tags.parquet`, model/video_tags.py):

    same-tag events     how many share the candidate's primary tag
    same-tag click rate (clicks + 1) / (events + 2) among those

and the click AUC of each as a score, beside the user's own click rate over the same events. A
sequence model that reads tags could learn either; docs/model.md ("Video tags") compares the HSTU
with them. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from tqdm import tqdm

from data.dataset import InferenceDataset
from data.schema import DEFAULT_SPLIT_DATE, beijing_midnight_ms
from model.metrics import auc
from model.video_tags import VideoTagTable

CLICK_BIT = 1


def probe(dataset: InferenceDataset, tags: VideoTagTable, window: int, split_date: int,
          max_requests: int | None = None) -> dict[str, float]:
    events = dataset.event_arrays()
    requests = dataset.requests
    chosen = np.flatnonzero(requests.time_ms >= beijing_midnight_ms(split_date))[:max_requests]
    rows = dataset.user_rows(requests.user_id[chosen])
    same, rate, user_rate, labels = [], [], [], []
    for i, row in tqdm(zip(chosen, rows), total=len(chosen), desc="tag probe", file=sys.stderr):
        base, end, m = events.offsets[row], requests.end[i], requests.num_candidates[i]
        seen = slice(base + max(0, end - window), base + end)
        history_tags = tags.rows(events.video_ids[seen])
        clicks = (events.action_weights[seen] & CLICK_BIT) > 0
        candidate_tags = tags.rows(events.video_ids[base + end: base + end + m])
        match = candidate_tags[:, None] == history_tags[None, :]  # [m, window]
        n, k = match.sum(1), (match & clicks[None, :]).sum(1)
        same.append(n)
        rate.append((k + 1) / (n + 2))
        user_rate.append(np.full(m, clicks.mean() if len(clicks) else 0.0))
        labels.append((events.action_weights[base + end: base + end + m] & CLICK_BIT) > 0)
    y = np.concatenate(labels)
    return {"candidates": len(y), "visits": len(chosen),
            "same_tag_events": auc(np.concatenate(same).astype(float), y),
            "same_tag_click_rate": auc(np.concatenate(rate), y),
            "user_click_rate": auc(np.concatenate(user_rate), y)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", required=True, help="preprocessor_inference.py output with video_tags.parquet")
    p.add_argument("--window", type=int, default=128, help="events before each visit the counts read")
    p.add_argument("--split_date", type=int, default=DEFAULT_SPLIT_DATE, help="YYYYMMDD: the visits scored")
    p.add_argument("--max_requests", type=int, default=None)
    p.add_argument("--output", default=None, help="JSON file")
    args = p.parse_args(argv)
    dataset = InferenceDataset(args.data_dir)
    tags = VideoTagTable.from_dataset_dir(dataset.root)
    if tags is None:
        print(f"error: {dataset.root} has no video tags", file=sys.stderr)
        return 2
    result = probe(dataset, tags, args.window, args.split_date, args.max_requests)
    print(f"click AUC over {result['candidates']} candidates of {result['visits']} visits, last {args.window} events:")
    for name in ("same_tag_events", "same_tag_click_rate", "user_click_rate"):
        print(f"  {name:<22}{result[name]:.4f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"window": args.window, "split_date": args.split_date, **result}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
