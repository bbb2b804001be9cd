"""The three files of a preprocessed output, built and written one way for every producer: the
preprocessor (data/preprocess.py, from raw logs) and the history store export (history/export.py,
from what was served), so that `InferenceDataset` and a trainer cannot tell them apart.

    events = Events(user_ids, user_offsets, user_id, video_id, time_ms, action_weights)
    split = split_requests(events.user_id, events.time_ms, params.session_gap_ms, params.num_candidates)
    manifest = output_manifest(params, events, split, vocabs, num_video_ids, input_files, source_counts)
    write_output(out, input_dir, events, features, vocabs, split.requests, manifest)

`source_counts` are the Counts fields that depend on where the events came from (rows read,
duplicates dropped, ...); the rest (users, events, visits, requests) follow from the events here.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import output, schema
from data.manifest import Counts, FeatureVocab, Manifest, PreprocessParams
from data.requests import RequestTable, VisitSplit


@dataclass(frozen=True)
class Events:
    """Deduplicated events sorted by (user_id, time_ms). Per-event arrays are [E] int64."""

    user_ids: np.ndarray  # [U] sorted distinct users
    user_offsets: np.ndarray  # [U + 1] user u owns events [user_offsets[u], user_offsets[u + 1])
    user_id: np.ndarray
    video_id: np.ndarray
    time_ms: np.ndarray
    action_weights: np.ndarray


def output_manifest(
    params: PreprocessParams,
    events: Events,
    split: VisitSplit,
    vocabs: tuple[FeatureVocab, ...],
    num_video_ids: int,
    input_files: Mapping[str, int],
    source_counts: Mapping[str, object],
) -> Manifest:
    """The manifest of an output holding `events` split into `split` (the counts it derives itself
    must not be in `source_counts`)."""
    counts = Counts(
        **source_counts,
        users=len(events.user_ids),
        events=len(events.user_id),
        visits=split.num_visits,
        requests=len(split.requests),
        users_without_requests=len(events.user_ids) - split.num_users_with_requests,
    )
    return Manifest(
        schema_version=schema.SCHEMA_VERSION,
        params=params,
        tasks=schema.TASKS,
        counts=counts,
        num_video_ids=num_video_ids,
        user_features=vocabs,
        input_files=dict(input_files),
    )


def write_output(
    out: Path,
    input_dir: Path | None,
    events: Events,
    features: np.ndarray,
    vocabs: tuple[FeatureVocab, ...],
    requests: RequestTable,
    manifest: Manifest,
    video_tags: pa.Table | None = None,
    video_side_features: pa.Table | None = None,
) -> None:
    """Write the output into `out`, replacing a previous one atomically (data/output.py; `input_dir`:
    the directory `out` must not overlap, None when the input is not a directory). `video_tags`
    (video_id, tag) and `video_side_features` (video_id, schema.VIDEO_SIDE_COLUMNS), when the source has
    them, become `schema.VIDEO_TAGS_FILE` and `schema.VIDEO_SIDE_FEATURES_FILE`."""
    sequences = sequences_table(events, features, vocabs)

    def write(directory: Path) -> None:
        pq.write_table(sequences, directory / schema.SEQUENCES_FILE, compression="zstd", use_dictionary=False)
        pq.write_table(requests.to_arrow(), directory / schema.REQUESTS_FILE, compression="zstd")
        if video_tags is not None:
            pq.write_table(video_tags, directory / schema.VIDEO_TAGS_FILE, compression="zstd")
        if video_side_features is not None:
            pq.write_table(video_side_features, directory / schema.VIDEO_SIDE_FEATURES_FILE, compression="zstd")
        (directory / schema.MANIFEST_FILE).write_text(manifest.to_json())  # last: marks the output complete

    output.replace_output(out, write, input_dir)


def sequences_table(events: Events, features: np.ndarray, vocabs: tuple[FeatureVocab, ...]) -> pa.Table:
    """One row per user: list<int64> columns built zero-copy from the flat arrays + offsets, then one
    int64 column per user feature ([U, F] `features`, columns named by `vocabs`)."""
    large = events.user_offsets[-1] >= 2**31
    offsets = pa.array(events.user_offsets, pa.int64() if large else pa.int32())
    list_type = pa.LargeListArray if large else pa.ListArray

    def as_list(values: np.ndarray) -> pa.Array:
        return list_type.from_arrays(offsets, pa.array(values, pa.int64()))

    columns = {
        "user_id": pa.array(events.user_ids, pa.int64()),
        "video_ids": as_list(events.video_id),
        "action_weights": as_list(events.action_weights),
        "timestamps": as_list(events.time_ms),
    }
    for j, vocab in enumerate(vocabs):
        columns[vocab.name] = pa.array(features[:, j], pa.int64())
    return pa.table(columns)
