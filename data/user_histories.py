"""UserHistories: the events of a set of users, flat and per user, and the model's batches over them.

The one place that turns a user's events into what the model reads (a `VisitBatch`): the offline
dataset (data/dataset.py, every user of a preprocessed output) and a history store's snapshot of a
batch's users (history/base.py) are both UserHistories, so a visit is built the same way whichever
way its events arrived.

    histories = UserHistories(events, where="store snapshot", video_counts=store.video_counters())
    ends = histories.history_ends(user_ids, request_times_ms)     # [B] events before each visit
    batch = histories.make_request_batch(user_ids, ends, starts, window_starts, ...)
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from data import jagged
from data.batch import VisitBatch
from data.candidate_counters import CandidateCounters, VideoCountSource


class UserEvents(NamedTuple):
    video_ids: np.ndarray  # [n] int64
    action_weights: np.ndarray  # [n] int64
    timestamps_ms: np.ndarray  # [n] int64
    prev_timestamp_ms: int  # time of the event before the range (of its first event at 0)
    user_features: np.ndarray  # [F] int64


class EventArrays(NamedTuple):
    """Every event of the dataset, flat and per user (read-only views): what derived indexes build on."""

    user_ids: np.ndarray  # [U] ascending
    offsets: np.ndarray  # [U + 1] user u's events are [offsets[u], offsets[u + 1])
    video_ids: np.ndarray  # [E]
    action_weights: np.ndarray  # [E]
    timestamps_ms: np.ndarray  # [E]
    user_features: np.ndarray  # [U, F]


class UnknownUserError(ValueError):
    """A request names a user the dataset has no events for."""


class UserHistories:
    def __init__(self, events: EventArrays, where: str, video_counts: VideoCountSource | None = None,
                 video_counters_until_ms: int | None = None) -> None:
        """`events` sorted by user, each user's by time (ties in arrival order); `where` names the source
        in errors. The candidates' video counters come from `video_counts` (a store's, over every user)
        or, when None, from `events` themselves, frozen at `video_counters_until_ms` when given."""
        self.where = where
        self.user_ids = events.user_ids  # [U] ascending
        self._offsets = events.offsets  # [U + 1]
        self._video_ids = events.video_ids  # [E]
        self._action_weights = events.action_weights  # [E]
        self._timestamps = events.timestamps_ms  # [E]
        self._user_features = events.user_features  # [U, F]
        self.video_counts = video_counts
        self.video_counters_until_ms = video_counters_until_ms
        self._counters: CandidateCounters | None = None  # built on first use

    @property
    def num_events(self) -> int:
        return len(self._video_ids)

    def snapshot(self, user_ids: np.ndarray, until_ms: np.ndarray) -> UserHistories:
        """These histories serve any visit of their users as they are (they are already in memory):
        a read-only history source for `InferenceSession`."""
        return self

    def history_length(self, user_id: int) -> int:
        """Number of events of `user_id` (KeyError for a user without events)."""
        row = int(np.searchsorted(self.user_ids, user_id))
        if row >= len(self.user_ids) or self.user_ids[row] != user_id:
            raise KeyError(f"user {user_id} has no events in {self.where}")
        return int(self._offsets[row + 1] - self._offsets[row])

    def user_events(self, user_id: int, start: int, end: int) -> UserEvents:
        """Views of events [start, end) of `user_id`, the event before them and the user's
        features: everything a cached range of K/V was computed from."""
        row = int(np.searchsorted(self.user_ids, user_id))
        if row >= len(self.user_ids) or self.user_ids[row] != user_id:
            raise KeyError(f"user {user_id} has no events in {self.where}")
        base, n = int(self._offsets[row]), int(self._offsets[row + 1] - self._offsets[row])
        if not 0 <= start <= end <= n:
            raise ValueError(f"user {user_id}: events [{start}, {end}) outside its {n} events")
        span = slice(base + start, base + end)
        return UserEvents(
            video_ids=self._video_ids[span],
            action_weights=self._action_weights[span],
            timestamps_ms=self._timestamps[span],
            prev_timestamp_ms=int(self._timestamps[base + max(start - 1, 0)]) if n else 0,
            user_features=self._user_features[row],
        )

    def event_arrays(self) -> EventArrays:
        return EventArrays(self.user_ids, self._offsets, self._video_ids, self._action_weights,
                           self._timestamps, self._user_features)

    # ------------------------------------------------------------ users
    def user_rows(self, user_ids: np.ndarray) -> np.ndarray:
        """[B] row of each user in the sequence arrays; `UnknownUserError` for a user without events."""
        user_ids = np.asarray(user_ids, dtype=np.int64).reshape(-1)
        rows = np.searchsorted(self.user_ids, user_ids)
        found = rows < len(self.user_ids)
        found[found] = self.user_ids[rows[found]] == user_ids[found]
        if not found.all():
            raise UnknownUserError(f"user {int(user_ids[~found][0])} has no events in {self.where}")
        return rows

    def history_ends(self, user_ids: np.ndarray, times_ms: np.ndarray) -> np.ndarray:
        """[B] number of each user's events strictly before `times_ms` (its history at that time).

        A vectorised binary search inside each user's (time-sorted) slice of the event arrays.
        """
        rows = self.user_rows(user_ids)
        times = np.asarray(times_ms, dtype=np.int64).reshape(-1)
        first_not_before = jagged.searchsorted_in_runs(self._timestamps, self._offsets[rows], self._offsets[rows + 1], times)
        return first_not_before - self._offsets[rows]

    # ------------------------------------------------------------ batches
    def make_request_batch(
        self,
        user_ids: np.ndarray,
        ends: np.ndarray,
        starts: np.ndarray,
        window_starts: np.ndarray,
        request_times_ms: np.ndarray,
        candidate_lengths: np.ndarray,
        candidate_video_ids: np.ndarray,
    ) -> VisitBatch:
        """The VisitBatch for ad-hoc requests (a serving node's): each user's events [starts, ends)
        with the given candidates and no labels."""
        rows = self.user_rows(user_ids)
        ends = np.asarray(ends, dtype=np.int64).reshape(-1)
        n_events = self._offsets[rows + 1] - self._offsets[rows]
        if np.any((ends < 1) | (ends > n_events)):
            b = int(np.flatnonzero((ends < 1) | (ends > n_events))[0])
            raise ValueError(f"user {int(user_ids[b])}: history end {int(ends[b])} outside [1, {int(n_events[b])}]")
        return self._visit_batch(
            rows, ends, starts, window_starts, np.full(len(rows), -1, dtype=np.int64),
            np.asarray(request_times_ms, dtype=np.int64).reshape(-1),
            np.asarray(candidate_lengths, dtype=np.int64).reshape(-1),
            np.asarray(candidate_video_ids, dtype=np.int64).reshape(-1), None,
        )

    def _visit_batch(
        self, row: np.ndarray, end: np.ndarray, starts: np.ndarray, window_starts: np.ndarray,
        request_ids: np.ndarray, request_times: np.ndarray, num_candidates: np.ndarray,
        candidate_video_ids: np.ndarray, labels: np.ndarray | None,
        candidate_history_ends: np.ndarray | None = None, candidate_times_ms: np.ndarray | None = None,
    ) -> VisitBatch:
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)  # [B]
        window_starts = np.asarray(window_starts, dtype=np.int64).reshape(-1)  # [B]
        if not len(row) == len(starts) == len(window_starts):
            raise ValueError(
                f"requests, starts and window_starts differ in length: {len(row)}, {len(starts)}, {len(window_starts)}"
            )
        user = self.user_ids[row]
        if len(np.unique(user)) != len(user):
            raise ValueError("a batch holds each user at most once (use InferenceDataset.batches)")
        bad = np.flatnonzero((window_starts < 0) | (window_starts > starts) | (starts > end))
        if len(bad):
            i = bad[0]
            raise ValueError(
                f"request {int(request_ids[i])} (user {int(user[i])}): invalid range "
                f"window_start={int(window_starts[i])}, start={int(starts[i])}, end={int(end[i])}; "
                "need 0 <= window_start <= start <= end"
            )
        base = self._offsets[row]  # [B] flat index of each user's event 0
        history_lengths = end - starts  # [B]
        events = jagged.range_indices(base + starts, history_lengths)  # [N]
        # A visit always has >= 1 event before `end`, so event max(start - 1, 0) exists.
        prev_timestamps = self._timestamps[base + np.maximum(starts - 1, 0)]  # [B]
        visit_of = np.repeat(np.arange(len(row)), num_candidates)  # [M]
        counter_ends = end[visit_of] if candidate_history_ends is None else candidate_history_ends
        counter_times = request_times[visit_of] if candidate_times_ms is None else candidate_times_ms
        return VisitBatch(
            request_ids=request_ids,
            user_ids=user,
            request_times_ms=request_times,
            window_starts=window_starts.copy(),
            starts=starts.copy(),
            history_lengths=history_lengths,
            prev_timestamps_ms=prev_timestamps,
            user_features=self._user_features[row],  # [B, F]
            video_ids=self._video_ids[events],
            action_weights=self._action_weights[events],
            timestamps_ms=self._timestamps[events],
            candidate_lengths=num_candidates,
            candidate_video_ids=candidate_video_ids,
            labels=labels,  # [M, num_tasks]
            candidate_counters=self.counters().for_candidates(row[visit_of], counter_ends, counter_times,
                                                              candidate_video_ids),
            candidate_history_ends=candidate_history_ends,
            candidate_times_ms=candidate_times_ms,
        )

    def counters(self) -> CandidateCounters:
        """The candidates' counting features (user, video, user x video) over every event (built once)."""
        if self._counters is None:
            self._counters = CandidateCounters.build(self.event_arrays(), self.video_counters_until_ms,
                                                     video=self.video_counts)
        return self._counters
