"""Filling a history store in bulk: from a preprocessed output (the usual start of a node's store) or
from the raw KuaiRand logs.

    bootstrap_from_output(store, "data/kuairand-1k", until_ms=split)   # the training period only
    bootstrap_from_logs(store, "KuaiRand-1K/data")                     # every raw row, deduplicated on the way

A preprocessed output keeps only the columns the model reads (its events are distinct, deduplicated on
every log column), so its events enter the store with the other log columns marked "not recorded":
-1, and `tab` = -1 - k for the k-th of the user's events that agree on every recorded column, which
keeps them distinct. A raw log row re-sent later with its original columns is therefore a new event
to the store; bootstrap from the logs when such rows may arrive again. Both are appends like any
other (idempotent, all or nothing per chunk): a bootstrap that was interrupted is finished by
running it again.

    python -m history.bootstrap --store sqlite:///var/lib/hstu/history.sqlite --data_dir data/kuairand-1k \
        [--until_date 20220501]          # only the events before that day (Beijing time)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data import raw, schema
from data.dataset import InferenceDataset
from data.event_rules import EVENT_KEY_COLUMNS
from data.manifest import Manifest
from history.base import AppendResult, HistoryStore
from history.events import EventBatch
from history.registry import open_history_store

CHUNK_EVENTS = 10_000  # an append holds a Redis server for its duration: keep each short
# The log columns a preprocessed output does not keep (date and hourmin follow from the time).
NOT_RECORDED = ("play_time_ms", "duration_ms", "profile_stay_time", "comment_stay_time", "is_rand", "tab")


def bootstrap_from_output(store: HistoryStore, data_dir: Path | str, until_ms: int | None = None,
                          progress: bool = True) -> AppendResult:
    """Every event of a preprocessed output before `until_ms` (all when None), the user features and
    the manifest (the feature vocabularies a checkpoint is checked against)."""
    dataset = InferenceDataset(data_dir)
    events = dataset_events(dataset)
    if until_ms is not None:
        events = events.take(events.time_ms < until_ms)
    store.put_manifest(dataset.manifest)
    arrays = dataset.event_arrays()
    store.set_user_features(arrays.user_ids, arrays.user_features)
    return _append_chunks(store, events, f"bootstrap {dataset.root}", progress)


def dataset_events(dataset: InferenceDataset) -> EventBatch:
    """Every event of a preprocessed dataset, in its order (by user, then time), keyed as described above."""
    events = dataset.event_arrays()
    user = np.repeat(events.user_ids, np.diff(events.offsets))
    key = EventBatch.from_columns({"user_id": user, "video_id": events.video_ids, "time_ms": events.timestamps_ms}).key_columns
    key[:, EVENT_KEY_COLUMNS.index("action_weights")] = events.action_weights
    for name in NOT_RECORDED:
        key[:, EVENT_KEY_COLUMNS.index(name)] = -1
    key[:, EVENT_KEY_COLUMNS.index("tab")] = -1 - _copy_rank(key)
    return EventBatch(key)


def bootstrap_from_logs(store: HistoryStore, raw_dir: Path | str, manifest: Manifest | None = None,
                        progress: bool = True) -> AppendResult:
    """The standard logs' rows in file order (early file first), as the preprocessor reads them, so the
    store holds the histories it would write (data/event_rules.py). User features are not read: pass
    the preprocessed output's `manifest` and use `bootstrap_from_output` for them."""
    src = raw.find_data_dir(raw_dir)
    if manifest is not None:
        store.put_manifest(manifest)
    total = AppendResult(0, 0, 0)
    for name in schema.STANDARD_LOGS:
        batch = EventBatch.from_log_table(raw.read_log(raw.required_file(src, name)))
        total = _add(total, _append_chunks(store, batch, f"bootstrap {name}", progress))
    return total


def _copy_rank(key: np.ndarray) -> np.ndarray:
    """[N] how many earlier rows (in row order) equal each row of `key` [N, C]."""
    order = np.lexsort((np.arange(len(key)), *key.T[::-1]))
    sorted_key = key[order]
    new_group = np.ones(len(key), dtype=bool)
    new_group[1:] = (sorted_key[1:] != sorted_key[:-1]).any(axis=1)
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(len(key)), 0))
    rank = np.empty(len(key), dtype=np.int64)
    rank[order] = np.arange(len(key)) - group_start
    return rank


def _append_chunks(store: HistoryStore, events: EventBatch, label: str, progress: bool) -> AppendResult:
    total = AppendResult(0, 0, 0)
    with tqdm(total=len(events), desc=label, unit="event", disable=not progress) as bar:
        for lo in range(0, len(events), CHUNK_EVENTS):
            chunk = events.take(slice(lo, lo + CHUNK_EVENTS))
            total = _add(total, store.append(chunk))
            bar.update(len(chunk))
    return total


def _add(a: AppendResult, b: AppendResult) -> AppendResult:
    return AppendResult(a.appended + b.appended, a.duplicates + b.duplicates, a.late + b.late)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Fill a history store from a preprocessed output (or raw logs).")
    p.add_argument("--store", required=True, help="history store URL (sqlite:///path, redis://host:port/db)")
    p.add_argument("--data_dir", required=True, help="preprocessed output: events, user features, vocabularies")
    p.add_argument("--raw_dir", default=None, help="take the events from these raw logs instead (every column)")
    p.add_argument("--until_date", type=int, default=None, help="YYYYMMDD: only events before that day (Beijing)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    until = None if args.until_date is None else schema.beijing_midnight_ms(args.until_date)
    if args.raw_dir is not None and until is not None:
        p.error("--until_date applies to --data_dir's events; raw logs are taken whole")
    with open_history_store(args.store) as store:
        if args.raw_dir is None:
            result = bootstrap_from_output(store, args.data_dir, until)
        else:
            dataset = InferenceDataset(args.data_dir)
            store.set_user_features(dataset.user_ids, dataset.event_arrays().user_features)
            result = bootstrap_from_logs(store, args.raw_dir, manifest=dataset.manifest)
        print(f"{store.description}: {result.appended} events stored, {result.duplicates} already there; "
              f"{store.num_events()} events of {len(store.stored_user_ids())} users in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
