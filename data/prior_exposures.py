"""How often a user was shown a video before a point of their history, and what they did with it.

    index = PriorExposures.build(dataset.event_arrays())
    counts = index.counts(rows, ends, video_ids)   # [M, 3], one entry per candidate

`counts[i] = (shown, clicks, long views)` for candidate i: its user's events before event `ends[i]`
with its video, and how many of them carry each counted action
(`schema.COUNTED_TASKS`). A ranker's "has this user seen / clicked this item before" cross
feature: a repeated exposure of a video the user clicked is far likelier to be clicked again.

One sorted key per event, `(user row, video rank, position)`, so a batch's counts are two
vectorised binary searches and a prefix-sum difference, whatever the history lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.jagged import sorted_lookup
from data.schema import counted_prefix_sums


@dataclass(frozen=True)
class PriorExposures:
    videos: np.ndarray  # [V] distinct video ids, ascending
    keys: np.ndarray  # [E] sorted (user row, video rank, position) keys
    positives_before: np.ndarray  # [E + 1, len(COUNTED_TASKS)] int32 positives among the first i sorted keys
    max_position: int  # positions (and history ends) are <= max_position

    @classmethod
    def build(cls, events) -> PriorExposures:
        """`events`: a dataset's `EventArrays` (flat per-user event arrays and offsets)."""
        lengths = np.diff(events.offsets)
        videos, video_rank = np.unique(events.video_ids, return_inverse=True)
        max_position = int(lengths.max(initial=0))
        if len(lengths) * (len(videos) + 1) * (max_position + 2) >= 2**62:
            raise ValueError(f"PriorExposures: {len(lengths)} users x {len(videos)} videos x {max_position} "
                             "positions do not fit one int64 key")
        rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        positions = np.arange(len(events.video_ids), dtype=np.int64) - np.repeat(events.offsets[:-1], lengths)
        keys = cls._key(rows, video_rank, positions, len(videos), max_position)
        order = np.argsort(keys, kind="stable")
        return cls(videos, keys[order], counted_prefix_sums(events.action_weights[order]), max_position)

    def counts(self, rows: np.ndarray, ends: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        """-> [M, 3] int64 (shown, clicks, long views) of each candidate's video before its history end.

        rows [M] user rows, ends [M] history ends, video_ids [M]."""
        rank, known = sorted_lookup(self.videos, video_ids)
        # A video the dataset never logged gets a rank no key has, so it counts nothing.
        rank = np.where(known, rank, len(self.videos))
        row, end = np.asarray(rows, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        lo = np.searchsorted(self.keys, self._key(row, rank, 0, len(self.videos), self.max_position))
        hi = np.searchsorted(self.keys, self._key(row, rank, np.minimum(end, self.max_position + 1),
                                                  len(self.videos), self.max_position))
        positives = self.positives_before[hi] - self.positives_before[lo]
        return np.concatenate([(hi - lo)[:, None], positives.astype(np.int64)], axis=1)

    @staticmethod
    def _key(row, video_rank, position, num_videos: int, max_position: int) -> np.ndarray:
        return (np.asarray(row, dtype=np.int64) * (num_videos + 1) + video_rank) * (max_position + 2) + position
