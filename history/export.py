"""Closing the loop: a history store written out as a preprocessed output, so that what was served
(the bootstrap plus every event logged live since) can be replayed and trained on.

    python -m history.export --store sqlite:///var/lib/hstu/history.sqlite --out artifacts/served
    manifest = export_store(store, "artifacts/served")      # then InferenceDataset("artifacts/served")

The output is the preprocessor's (data/output_files.py writes both): sequences.parquet with every
stored event of every user in history order and the users' encoded features, requests.parquet split
into visits from those events (data/requests.py) with the store manifest's PreprocessParams unless
others are given, and manifest.json, replaced atomically (data/output.py). The manifest keeps the
store manifest's feature vocabularies, so a checkpoint trained on the bootstrap data still fits, and
`num_video_ids` never shrinks below the bootstrap's (live events may add videos past it). Its counts
describe the export: `rows_read` = the stored events, under EXPORT_SOURCE; nothing is dropped (the
store deduplicated on arrival); the raw-row checks that need columns a store does not read back
(`rows_nonpositive_duration`, `rows_long_view_mismatch`) and users with features but no events are
0; `users_without_features` counts users whose features are all 0. Nothing names the store's
location, so two stores with the same events export byte-identical files.

A store that was never bootstrapped has no manifest: the export refuses it (`ExportError`) rather
than write an output without user features, which no checkpoint trained with them could read and
which would train a model blind to them without saying so. Bootstrap it first (history/bootstrap.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data import output
from data.manifest import Manifest, PreprocessParams
from data.output_files import Events, output_manifest, write_output
from data.requests import split_requests
from history.base import HistoryStore
from history.registry import open_history_store

EXPORT_SOURCE = "history store"  # the one "file" an export reads, in the manifest's per-file counts
UNTIL_ALL = 2**62  # a read's `until_ms` past every event, and still an int64 every store binds
CHUNK_USERS = 1_000  # users per store.read: bounded memory per query, few round trips


class ExportError(ValueError):
    """The store cannot be exported (nothing was written)."""


def export_store(store: HistoryStore, out_dir: Path | str, params: PreprocessParams | None = None,
                 progress: bool = True) -> Manifest:
    """Write every event of `store` into `out_dir` as a preprocessed output (replaced atomically)
    and return its manifest. `params` (visits, candidates) default to the store manifest's.

    Raises ExportError for a store without a manifest or without events, ValueError for bad
    params and output.OutputDirError for an unsafe `out_dir`; nothing is written then."""
    if store.retention is not None:
        raise ExportError(f"{store.description} folds each user's events beyond the last {store.retention.keep_events} "
                          "into counters (history/retention.py): an export would hold stand-ins, not the events")
    stored = store.get_manifest()
    if stored is None:
        raise ExportError(
            f"{store.description}: the store holds no manifest (it was never bootstrapped), so the user "
            "features' vocabularies are unknown; bootstrap it first (history.bootstrap.bootstrap_from_output, "
            "or bootstrap_from_logs with the preprocessed output's manifest)")
    params = params if params is not None else stored.params
    params.validate()
    out = Path(os.path.abspath(out_dir))
    # A SQLite store is a file: the output must not hold it (a server's store is nowhere here).
    store_path = getattr(store, "path", None)
    input_path = Path(os.path.abspath(store_path)) if isinstance(store_path, (str, Path)) else None
    output.check_target(out, input_path)  # before the long read: refuse early

    events, features = read_store(store, len(stored.user_features), progress)
    if len(events.user_id) == 0:
        raise ExportError(f"{store.description}: the store holds no events; nothing to export")
    split = split_requests(events.user_id, events.time_ms, params.session_gap_ms, params.num_candidates)
    manifest = output_manifest(
        params, events, split, stored.user_features,
        num_video_ids=max(stored.num_video_ids, int(events.video_id.max()) + 1),
        input_files={},  # no files: the source is the store, which the manifest does not name
        source_counts=dict(
            rows_read={EXPORT_SOURCE: len(events.user_id)},
            duplicate_rows_dropped={EXPORT_SOURCE: 0},
            users_without_events_in_file={EXPORT_SOURCE: 0},
            rows_nonpositive_duration=0,
            rows_long_view_mismatch=0,
            users_without_features=int((features == 0).all(axis=1).sum()),
            feature_users_without_events=0,
        ),
    )
    write_output(out, input_path, events, features, stored.user_features, split.requests, manifest)
    return manifest


def read_store(store: HistoryStore, num_features: int, progress: bool = True) -> tuple[Events, np.ndarray]:
    """Every stored event (`Events`, users ascending, each user's in history order) and the [U, F]
    user features, read `CHUNK_USERS` users at a time. Each chunk is one consistent read; a store
    appended to meanwhile exports the users known when the export began, each chunk as of its read."""
    users = store.stored_user_ids()
    parts = []
    with tqdm(total=len(users), desc=f"export {store.description}", unit="user", disable=not progress) as bar:
        for lo in range(0, len(users), CHUNK_USERS):
            chunk = users[lo:lo + CHUNK_USERS]
            parts.append(store.read(chunk, np.full(len(chunk), UNTIL_ALL, dtype=np.int64)))
            bar.update(len(chunk))
    lengths = np.concatenate([np.diff(p.offsets) for p in parts]) if parts else np.zeros(0, np.int64)
    offsets = np.zeros(len(users) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def flat(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)

    features = np.zeros((len(users), num_features), dtype=np.int64)
    if parts:
        stacked = np.concatenate([p.user_features for p in parts])
        if stacked.shape != features.shape:
            raise ExportError(f"{store.description}: read {stacked.shape[1]} features per user, "
                              f"the store manifest names {num_features}")
        features[:] = stacked
    users = users.astype(np.int64)
    events = Events(user_ids=users, user_offsets=offsets, user_id=np.repeat(users, lengths), video_id=flat("video_ids"),
                    time_ms=flat("timestamps_ms"), action_weights=flat("action_weights"))
    return events, features


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export a history store as a preprocessed output (history/export.py).")
    parser.add_argument("--store", required=True, help="history store URL: sqlite:///path or redis://host:port/db")
    parser.add_argument("--out", required=True, type=Path,
                        help="output directory, written atomically (created, or replacing a previous output)")
    parser.add_argument("--session_gap_minutes", type=float, default=None,
                        help="inactivity that ends a visit (default: the store manifest's)")
    parser.add_argument("--num_candidates", type=int, default=None,
                        help="max candidates per request (default: the store manifest's)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)

    local = args.store.removeprefix("sqlite://")
    if "://" not in local and not Path(local).is_file():  # opening would create an empty store there
        print(f"error: {local}: no history store there", file=sys.stderr)
        return 1
    try:
        with open_history_store(args.store) as store:
            params = None
            if args.session_gap_minutes is not None or args.num_candidates is not None:
                stored = store.get_manifest()
                base = stored.params if stored is not None else PreprocessParams()
                overrides = {"session_gap_minutes": args.session_gap_minutes, "num_candidates": args.num_candidates}
                params = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
            manifest = export_store(store, args.out, params, progress=not args.no_progress)
    except (ValueError, OSError, RuntimeError) as err:  # ExportError, OutputDirError, HistoryUnavailableError
        print(f"error: {err}", file=sys.stderr)
        return 1
    c = manifest.counts
    print(f"wrote {args.out}: {c.users} users, {c.events} events, {c.visits} visits, {c.requests} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
