"""The counting features of a batch's candidates: what was logged before the visit, by whom, of what.

    counters = CandidateCounters.build(dataset.event_arrays(), video_until_ms=None)
    counts = counters.for_candidates(rows, ends, times_ms, video_ids)   # one entry per candidate
    counts.shape == (M, len(FAMILIES), 3)       # family x (shown, clicks, long views)

    user        the user's own events before the visit (their whole history, not only the window)
    video       every user's events of the candidate's video before the request time
                (data/video_counters.py; frozen at `video_until_ms` when given)
    user_video  the user's earlier events of this very video (data/prior_exposures.py)

A production ranker reads such counters from a feature store; here they come from the log
itself, exact at each request, and never include the visit's own events (strictly before its
history end / request time), so a training candidate cannot see its own label through them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from data.prior_exposures import PriorExposures
from data.schema import counted_prefix_sums
from data.video_counters import VideoCounters

FAMILIES = ("user", "video", "user_video")


class VideoCountSource(Protocol):
    """Per-video (shown, clicks, long views) over every user's events before each time: `VideoCounters`
    over a log, or a history store's counters over everything it holds."""

    def counts(self, video_ids: np.ndarray, times_ms: np.ndarray) -> np.ndarray: ...  # [M, 3] int64


@dataclass(frozen=True)
class CandidateCounters:
    user_offsets: np.ndarray  # [U + 1] user row r's events are [user_offsets[r], user_offsets[r + 1])
    user_positives_before: np.ndarray  # [E + 1, len(COUNTED_TASKS)] int32 prefix sums over the flat events
    video: VideoCountSource
    user_video: PriorExposures

    @classmethod
    def build(cls, events, video_until_ms: int | None = None, video: VideoCountSource | None = None
              ) -> CandidateCounters:
        """`events`: `EventArrays`; the video family from `video`, or when None from `events` themselves."""
        video = video if video is not None else VideoCounters.build(events, video_until_ms)
        return cls(events.offsets, counted_prefix_sums(events.action_weights), video, PriorExposures.build(events))

    def for_candidates(self, rows: np.ndarray, ends: np.ndarray, times_ms: np.ndarray,
                       video_ids: np.ndarray) -> np.ndarray:
        """-> [M, len(FAMILIES), 3] int64 (shown, clicks, long views) per family.

        Per candidate [M]: its user's row, the history end it sees (events before it count), its time
        (every user's events of its video before it count) and its video id."""
        rows = np.asarray(rows, dtype=np.int64)
        first, last = self.user_offsets[rows], self.user_offsets[rows] + np.asarray(ends, dtype=np.int64)
        user = np.concatenate([(last - first)[:, None],
                               (self.user_positives_before[last] - self.user_positives_before[first]).astype(np.int64)], 1)
        video = self.video.counts(video_ids, times_ms)
        pair = self.user_video.counts(rows, ends, video_ids)
        return np.stack([user, video, pair], axis=1)
