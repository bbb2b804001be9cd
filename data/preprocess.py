"""Raw KuaiRand-1K logs -> per-user sequences + time-ordered requests (Parquet) + manifest.

Steps: read and validate the two standard logs, the user features and, when the basic video
features are there, each video's primary tag and side features (data/raw.py `read_video_tags`,
`read_video_side_features`); stably sort
events by (user_id, time_ms) with ties in file order (early file first, then row
order); drop exact duplicate rows (the first copy is kept); split each user's events
into visits and requests (data/requests.py); encode the user features; write all of it
atomically. The random log is not read: its randomly exposed videos are not part of
the users' organic histories. Everything is vectorised numpy/pyarrow, so 11.7M rows
cost a small multiple of just parsing the CSVs.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from data import output, raw, schema
from data.event_rules import DEDUP_COLUMNS, duplicate_mask, stable_order
from data.manifest import FeatureVocab, Manifest, PreprocessParams
from data.output_files import Events, output_manifest, write_output
from data.requests import split_requests


def preprocess(
    data_dir: Path | str,
    output_dir: Path | str,
    params: PreprocessParams | None = None,
    progress: bool = True,
) -> Manifest:
    """Preprocess a KuaiRand-1K directory into `output_dir` (replaced atomically; default params).

    Raises ValueError for bad parameters, output.OutputDirError for an output location that is
    unsafe to replace and raw.RawDataError for bad input; in all cases nothing is written and
    an existing `output_dir` is untouched. See data/output.py for the replacement protocol.
    """
    params = params if params is not None else PreprocessParams()
    params.validate()
    out = Path(os.path.abspath(output_dir))  # "." and ".." resolved, symlinks kept (and refused)
    src = raw.find_data_dir(data_dir)
    output.check_target(out, src)
    log_paths = [raw.required_file(src, name) for name in schema.STANDARD_LOGS]
    features_path = raw.required_file(src, schema.USER_FEATURES)
    tags_path = src / schema.VIDEO_FEATURES_BASIC
    tags_path = tags_path if tags_path.is_file() else None

    with _stages(progress) as stage:
        stage("read logs")
        logs = _read_logs(log_paths)
        stage("read user features")
        feature_table = raw.read_user_features(features_path)
        stage("read video features")
        video_tags = raw.read_video_tags(tags_path) if tags_path is not None else None
        side_features = raw.read_video_side_features(tags_path) if tags_path is not None else None
        stage("sort + deduplicate")
        events, file_counts = _sort_and_dedup(logs, log_paths)
        rows_read = logs.rows_read
        del logs
        stage("split visits")
        split = split_requests(events.user_id, events.time_ms, params.session_gap_ms, params.num_candidates)
        stage("encode user features")
        features, vocabs, feature_counts = encode_user_features(feature_table, events.user_ids)
        manifest = output_manifest(
            params, events, split, vocabs,
            num_video_ids=int(events.video_id.max()) + 1,
            input_files={p.name: p.stat().st_size for p in (*log_paths, features_path, tags_path) if p is not None},
            source_counts={"rows_read": dict(zip(schema.STANDARD_LOGS, rows_read)), **file_counts, **feature_counts},
        )  # fmt: skip
        stage("write")
        write_output(out, src, events, features, vocabs, split.requests, manifest, video_tags, side_features)
    return manifest


# ---------------------------------------------------------------- reading
@dataclass(frozen=True)
class RawLogs:
    """Both standard logs in file order (early file first), as numpy [N] columns."""

    user_id: np.ndarray
    time_ms: np.ndarray
    video_id: np.ndarray
    rest: dict[str, np.ndarray]  # DEDUP_COLUMNS, action_weights included
    long_view: np.ndarray  # uint8, for the long_view rule count
    rows_read: list[int]  # per file, in file order


def _read_logs(paths: list[Path]) -> RawLogs:
    tables = [raw.read_log(p) for p in paths]
    rows = [t.num_rows for t in tables]
    if sum(rows) == 0:
        raise raw.RawDataError(paths[0].parent, "the standard logs contain no rows")
    table = pa.concat_tables(tables)
    del tables
    # The 0/1 flags (validated) travel as uint8 and become action_weights, which encodes
    # them losslessly; other columns are copied out one by one, freeing arrow memory.
    flags = {name: pc.cast(table.column(name), pa.uint8()).to_numpy() for name in schema.ACTION_COLUMNS}
    table = table.drop_columns(list(schema.ACTION_COLUMNS))
    columns = {}
    for name in table.column_names:
        columns[name] = table.column(name).to_numpy()
        table = table.drop_columns([name])
    columns["action_weights"] = schema.action_weights(flags)
    return RawLogs(
        user_id=columns["user_id"],
        time_ms=columns["time_ms"],
        video_id=columns["video_id"],
        rest={name: columns[name] for name in DEDUP_COLUMNS},
        long_view=flags["long_view"],
        rows_read=rows,
    )


# ---------------------------------------------------------------- sort + dedup
def _odd_rows(logs: RawLogs, rows: np.ndarray | slice) -> np.ndarray:
    """[duration_ms <= 0, long_view rule mismatch] counts over input `rows`; the rule is
    judged only where duration_ms > 0: long_view == (play_time_ms >= min(duration_ms, 18 s))."""
    duration, play = logs.rest["duration_ms"][rows], logs.rest["play_time_ms"][rows]
    reach = play >= np.minimum(duration, schema.LONG_VIEW_CAP_MS)
    mismatch = (duration > 0) & (reach != (logs.long_view[rows] == 1))
    return np.array([np.count_nonzero(duration <= 0), np.count_nonzero(mismatch)])


def _sort_and_dedup(logs: RawLogs, paths: list[Path]) -> tuple[Events, dict[str, object]]:
    order = stable_order(logs.user_id, logs.time_ms)  # [N] sorted position -> input row
    user, time, video = logs.user_id[order], logs.time_ms[order], logs.video_id[order]
    dup = duplicate_mask(user, time, video, order, list(logs.rest.values()))
    keep = ~dup
    kept = order[keep]  # [E] input rows of the events, in event order

    file_of_row = np.searchsorted(np.cumsum(logs.rows_read), order, side="right")  # [N] file index
    new_user = np.ones(len(user), dtype=bool)
    new_user[1:] = user[1:] != user[:-1]
    user_index = np.cumsum(new_user) - 1
    num_users = int(user_index[-1]) + 1
    users_in_file = [np.bincount(user_index[file_of_row == f], minlength=num_users) > 0 for f in range(len(paths))]
    nonpositive, mismatch = _odd_rows(logs, slice(None)) - _odd_rows(logs, order[dup])  # kept rows

    events = Events(
        user_ids=user[new_user],
        user_offsets=np.append(np.flatnonzero(new_user[keep]), len(kept)).astype(np.int64),
        user_id=user[keep],
        video_id=video[keep],
        time_ms=time[keep],
        action_weights=logs.rest["action_weights"][kept],
    )
    names = [p.name for p in paths]
    counts = {
        "duplicate_rows_dropped": dict(zip(names, np.bincount(file_of_row[dup], minlength=len(paths)).tolist())),
        "users_without_events_in_file": {n: int(num_users - has.sum()) for n, has in zip(names, users_in_file)},
        "rows_nonpositive_duration": int(nonpositive),
        "rows_long_view_mismatch": int(mismatch),
    }
    return events, counts


# ---------------------------------------------------------------- user features
def encode_user_features(
    table: pa.Table, user_ids: np.ndarray
) -> tuple[np.ndarray, tuple[FeatureVocab, ...], dict[str, int]]:
    """user_features rows -> ([U, F] int64 ids for `user_ids` (sorted), vocabularies, counts).

    The vocabulary of each feature is built from the whole file (see schema.UserFeature),
    so it does not depend on which users happen to have events."""
    file_users = table.column("user_id").to_numpy()
    order = np.argsort(file_users)
    pos = np.clip(np.searchsorted(file_users, user_ids, sorter=order), 0, max(len(file_users) - 1, 0))
    row = order[pos] if len(file_users) else np.zeros(len(user_ids), dtype=np.int64)
    found = file_users[row] == user_ids if len(file_users) else np.zeros(len(user_ids), dtype=bool)

    encoded = np.zeros((len(user_ids), len(schema.CONTEXT_FEATURES)), dtype=np.int64)
    vocabs = []
    for j, feature in enumerate(schema.CONTEXT_FEATURES):
        ids, values = _encode_column(feature, table.column(feature.column))
        encoded[found, j] = ids[row[found]]
        vocabs.append(FeatureVocab(feature.column, values))
    counts = {
        "users_without_features": int((~found).sum()),
        "feature_users_without_events": int(len(file_users) - found.sum()),
    }
    return encoded, tuple(vocabs), counts


def _encode_column(feature: schema.UserFeature, column: pa.ChunkedArray) -> tuple[np.ndarray, tuple]:
    """[rows] raw values -> ([rows] int64 ids, vocabulary); id 0 = missing or unknown."""
    if feature.is_text:
        raw_values = column.to_pylist()
        seen = {v for v in raw_values if v is not None} - set(feature.unknown) - set(feature.labels)
        vocab = (*feature.labels, *sorted(seen))
        index = {label: i + 1 for i, label in enumerate(vocab)}
        return np.array([index.get(v, 0) for v in raw_values], dtype=np.int64), vocab
    values = column.to_numpy()  # float64, NaN = missing
    present = ~np.isnan(values)
    for unknown in feature.unknown:
        present &= values != unknown
    vocab = np.unique(values[present]).astype(np.int64)
    ids = np.zeros(len(values), dtype=np.int64)
    ids[present] = np.searchsorted(vocab, values[present].astype(np.int64)) + 1
    return ids, tuple(vocab.tolist())


# ---------------------------------------------------------------- progress
@contextmanager
def _stages(enabled: bool) -> Iterator:
    """A one-bar tqdm over the pipeline stages (stderr); `stage(name)` starts the next one."""
    bar = tqdm(total=7, disable=not enabled, file=sys.stderr, unit="stage", desc="preprocess")
    started = []

    def stage(name: str) -> None:
        if started:
            bar.update(1)
        started.append(name)
        bar.set_description(f"preprocess: {name}")

    try:
        yield stage
        bar.update(1)
    finally:
        bar.close()
