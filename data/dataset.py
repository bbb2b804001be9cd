"""InferenceDataset: the preprocessed output, served as time-ordered batches of visits.

Sequences live in memory as flat per-event arrays plus per-user offsets (11.7M events
are ~300 MB), so serving any event range of any user is two array slices. The caller
(the inference loop) decides which part of a visit's history it still has to compute
-- everything before `starts` is cached -- and `make_batch` carries exactly that.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import jagged, output, schema
from data.batch import VisitBatch
from data.manifest import Manifest
from data.requests import RequestTable
from data.user_histories import EventArrays, UnknownUserError, UserEvents, UserHistories

__all__ = ["EventArrays", "InferenceDataset", "UnknownUserError", "UserEvents"]

log = logging.getLogger(__name__)

class InferenceDataset(UserHistories):
    def __init__(self, root: Path | str, video_counters_until_ms: int | None = None):
        """Load `root` (an output of preprocessor_inference.py; see data.output.readable_output
        for a run killed while replacing it). Raises FileNotFoundError or ValueError naming the
        file and the problem when it is missing or inconsistent.

        Batches carry their candidates' counting features (data/candidate_counters.py); the video
        counters are those as of the request time, or frozen at `video_counters_until_ms` (an
        evaluation that must not read other users' events after its split)."""
        if video_counters_until_ms is not None and not (
            isinstance(video_counters_until_ms, (int, np.integer))
            and schema.TIME_MS_RANGE[0] <= video_counters_until_ms <= schema.TIME_MS_RANGE[1]
        ):
            raise ValueError(f"video_counters_until_ms must be epoch milliseconds in {schema.TIME_MS_RANGE_TEXT}, "
                             f"got {video_counters_until_ms!r}")
        requested = Path(root)
        source = output.readable_output(requested)
        if source is None:
            raise FileNotFoundError(f"{requested}: preprocessed output directory not found")
        if source != requested:
            log.warning("%s is missing: reading %s, the complete output a killed preprocessing run left "
                        "beside it (the next run into %s puts things in place)", requested, source, requested)
        self.root = source
        self.manifest = Manifest.read(self.root / schema.MANIFEST_FILE)
        sequences = pq.read_table(self._file(schema.SEQUENCES_FILE))
        requests = pq.read_table(self._file(schema.REQUESTS_FILE))
        sequence_columns = ("user_id", *schema.SEQUENCE_LIST_COLUMNS, *self.manifest.user_feature_names)
        self._check_columns(schema.SEQUENCES_FILE, sequences, sequence_columns)
        self._check_columns(schema.REQUESTS_FILE, requests, schema.REQUEST_COLUMNS)

        user_ids = sequences.column("user_id").to_numpy()  # [U] ascending
        flat = {name: _flat_list(sequences.column(name)) for name in schema.SEQUENCE_LIST_COLUMNS}
        offsets = flat["video_ids"][1]  # [U + 1]
        if any(not np.array_equal(o, offsets) for _, o in flat.values()):
            raise ValueError(f"{self.root / schema.SEQUENCES_FILE}: list columns have different lengths")
        user_features = np.stack(  # [U, F]
            [sequences.column(n).to_numpy() for n in self.manifest.user_feature_names], axis=1
        ).astype(np.int64).reshape(len(user_ids), -1)
        events = EventArrays(user_ids, offsets, flat["video_ids"][0], flat["action_weights"][0],
                             flat["timestamps"][0], user_features)
        super().__init__(events, str(self.root), video_counters_until_ms=video_counters_until_ms)

        self.requests = RequestTable.from_arrow(requests)
        self._request_user_row = np.searchsorted(self.user_ids, self.requests.user_id)  # [R]
        self._validate()

    # ------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_user_features(self) -> int:
        return len(self.manifest.user_features)

    @property
    def user_feature_cardinalities(self) -> tuple[int, ...]:
        return self.manifest.user_feature_cardinalities

    @property
    def num_tasks(self) -> int:
        return len(self.manifest.tasks)

    # ------------------------------------------------------------ replay order
    def request_indices(
        self, from_time_ms: int | None = None, until_time_ms: int | None = None, max_requests: int | None = None
    ) -> np.ndarray:
        """[n] indices of the requests with from_time_ms <= time_ms < until_time_ms, in time
        order, at most `max_requests` (the earliest)."""
        times = self.requests.time_ms
        lo = 0 if from_time_ms is None else int(np.searchsorted(times, from_time_ms, side="left"))
        hi = len(times) if until_time_ms is None else int(np.searchsorted(times, until_time_ms, side="left"))
        hi = max(lo, hi) if max_requests is None else min(max(lo, hi), lo + max_requests)
        return np.arange(lo, hi, dtype=np.int64)

    def candidate_video_ids(self, indices: np.ndarray) -> list[np.ndarray]:
        """The videos shown at each of these visits (its candidates), in the given order."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        req = self.requests
        first = self._offsets[self._request_user_row[idx]] + req.end[idx]  # [n] first candidate event
        return [self._video_ids[s:s + n] for s, n in zip(first.tolist(), req.num_candidates[idx].tolist())]

    def batches(self, indices: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
        """Cut `indices` into consecutive batches without reordering them: a batch ends when
        it is full or when the next request's user is already in it (a user's visits must
        run one after the other, each on the previous one's cache)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        users = self.requests.user_id
        batch: list[int] = []
        seen: set[int] = set()
        for index in np.asarray(indices, dtype=np.int64).tolist():
            user = int(users[index])
            if len(batch) == batch_size or user in seen:
                yield np.asarray(batch, dtype=np.int64)
                batch, seen = [], set()
            batch.append(index)
            seen.add(user)
        if batch:
            yield np.asarray(batch, dtype=np.int64)

    # ------------------------------------------------------------ batches
    def make_batch(self, indices: np.ndarray, starts: np.ndarray, window_starts: np.ndarray,
                   history_targets: int = 0) -> VisitBatch:
        """The VisitBatch for requests `indices` carrying events [starts[i], end_i) of each
        user, with window_starts[i] <= starts[i] <= end_i. Candidates are the request's
        events [end_i, end_i + num_candidates_i); labels are their action bits.

        `history_targets` > 0 (training) puts each visit's last that many carried events before its
        candidates as candidates too, each seeing only the events before it and scored at its own
        time: every position of the history becomes a target, as generative recommenders train."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)  # [B]
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"request index out of range [0, {len(self)}): {idx[(idx < 0) | (idx >= len(self))][0]}")
        if history_targets < 0:
            raise ValueError(f"history_targets must be >= 0, got {history_targets}")
        req = self.requests
        row = self._request_user_row[idx]  # [B]
        end, num_candidates = req.end[idx], req.num_candidates[idx]
        candidates = jagged.range_indices(self._offsets[row] + end, num_candidates)  # [M]
        if not history_targets:
            return self._visit_batch(
                row, end, starts, window_starts, req.request_id[idx], req.time_ms[idx],
                num_candidates, self._video_ids[candidates], schema.action_labels(self._action_weights[candidates]),
            )
        targets_per_visit = np.minimum(history_targets, end - np.asarray(starts, dtype=np.int64).reshape(-1))
        targets = jagged.range_indices(self._offsets[row] + end - targets_per_visit, targets_per_visit)  # flat events
        target_slots, candidate_slots = jagged.concat_rows(targets_per_visit, num_candidates)

        def merged(of_targets: np.ndarray, of_candidates: np.ndarray) -> np.ndarray:
            out = np.empty((len(target_slots) + len(candidate_slots), *of_targets.shape[1:]), of_targets.dtype)
            out[target_slots], out[candidate_slots] = of_targets, of_candidates
            return out

        events = merged(targets, candidates)
        user_index = np.repeat(np.arange(len(idx)), num_candidates)
        return self._visit_batch(
            row, end, starts, window_starts, req.request_id[idx], req.time_ms[idx],
            targets_per_visit + num_candidates, self._video_ids[events], schema.action_labels(self._action_weights[events]),
            candidate_history_ends=merged(targets - self._offsets[np.repeat(row, targets_per_visit)], end[user_index]),
            candidate_times_ms=merged(self._timestamps[targets], req.time_ms[idx][user_index]),
        )

    # ------------------------------------------------------------ loading helpers
    def _file(self, name: str) -> Path:
        path = self.root / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing from the preprocessed output")
        return path

    def _check_columns(self, name: str, table: pa.Table, columns: tuple[str, ...]) -> None:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise ValueError(f"{self.root / name}: missing column '{missing[0]}'")

    def _validate(self) -> None:
        """Cheap cross-checks that catch a manifest from another run or a truncated file."""
        counts, req = self.manifest.counts, self.requests
        where = self.root / schema.REQUESTS_FILE
        if len(req) != counts.requests or len(self._video_ids) != counts.events:
            raise ValueError(
                f"{self.root}: files disagree with {schema.MANIFEST_FILE} ({len(req)} requests, "
                f"{len(self._video_ids)} events; manifest says {counts.requests}, {counts.events})"
            )
        if len(req) == 0:
            return
        if np.any(np.diff(req.time_ms) < 0) or not np.array_equal(req.request_id, np.arange(len(req))):
            raise ValueError(f"{where}: requests are not numbered in time order")
        row = np.minimum(self._request_user_row, len(self.user_ids) - 1)
        if np.any(self.user_ids[row] != req.user_id):
            raise ValueError(f"{where}: a request's user has no sequence")
        user_events = self._offsets[row + 1] - self._offsets[row]
        if np.any((req.start < 0) | (req.start >= req.end) | (req.num_candidates < 1)
                  | (req.end + req.num_candidates > user_events)):  # fmt: skip
            raise ValueError(f"{where}: a request's range lies outside its user's events")


def _flat_list(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """list<int64> column -> ([E] values, [U + 1] int64 offsets starting at 0)."""
    lists = column.combine_chunks()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    return lists.flatten().to_numpy().astype(np.int64, copy=False), offsets - offsets[0]
