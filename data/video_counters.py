"""Per-video counters as of a moment: how often a video was shown before it, and how often clicked
or long-viewed. A ranker's item statistics (what KuaiRand's `video_features_statistic` holds),
computed from the log itself so that they are exact at every request time.

    counters = VideoCounters.build(dataset.event_arrays(), until_ms=None)
    counts = counters.counts(video_ids, times_ms)        # [M, 3] (shown, clicks, long views)

`counts[i]` covers every user's events with video `video_ids[i]` strictly before `times_ms[i]`
(and before `until_ms`, when given: counters frozen at that moment). Strictly before the request
time, a training candidate never counts its own event or anything after it, so the statistic
cannot leak its label. With `until_ms` = the split date, an evaluated visit reads the training
period's statistics only, as the baselines do.

Events sorted by (video, time) with prefix sums of the two actions: a batch's counts are a
vectorised binary search per candidate inside its video's run, O(M log E).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.jagged import searchsorted_in_runs, sorted_lookup
from data.schema import counted_prefix_sums


@dataclass(frozen=True)
class VideoCounters:
    videos: np.ndarray  # [V] distinct video ids, ascending
    runs: np.ndarray  # [V + 1] video rank r's events are [runs[r], runs[r + 1]) in the sorted arrays
    times_ms: np.ndarray  # [E] event times, ascending within each video's run
    positives_before: np.ndarray  # [E + 1, len(schema.COUNTED_TASKS)] int32 positives among the first i sorted events
    until_ms: int | None

    @classmethod
    def build(cls, events, until_ms: int | None = None) -> VideoCounters:
        """`events`: a dataset's `EventArrays`; only events before `until_ms` (all, if None) count."""
        keep = slice(None) if until_ms is None else events.timestamps_ms < until_ms
        video_ids, times = events.video_ids[keep], events.timestamps_ms[keep]
        order = np.lexsort((times, video_ids))
        videos, run_lengths = np.unique(video_ids[order], return_counts=True)
        positives_before = counted_prefix_sums(events.action_weights[keep][order])
        runs = np.concatenate(([0], np.cumsum(run_lengths))).astype(np.int64)
        return cls(videos, runs, times[order], positives_before, until_ms)

    def counts(self, video_ids: np.ndarray, times_ms: np.ndarray) -> np.ndarray:
        """-> [M, 3] int64: (shown, clicks, long views) of each video before each time."""
        video_ids = np.asarray(video_ids, dtype=np.int64).reshape(-1)
        times = np.asarray(times_ms, dtype=np.int64).reshape(-1)
        if self.until_ms is not None:
            times = np.minimum(times, self.until_ms)
        rank, known = sorted_lookup(self.videos, video_ids)
        start = np.where(known, self.runs[rank], 0)
        end = np.where(known, self.runs[np.minimum(rank + 1, len(self.videos))], 0)
        first_not_before = searchsorted_in_runs(self.times_ms, start, end, times)
        shown = first_not_before - start
        positives = self.positives_before[first_not_before] - self.positives_before[start]
        return np.concatenate([shown[:, None], positives.astype(np.int64)], axis=1)
