"""A last-items Markov model: how often a video was acted on when it followed the videos a user just saw.

Fitted on labelled training visits, each one read as transitions (h -> c) from each of the visit's
last `last_events` history videos h to each of its candidates c. For a scored candidate c after
history videos h_1..h_k, per task t:

    score_t = (sum_i positives_t(h_i -> c) + shrinkage x rate_t(c)) / (sum_i shown(h_i -> c) + shrinkage)
    rate_t(c) = (positives_t(c) + prior x global_t) / (shown(c) + prior)

the transitions' positive rate, backed off to the candidate's own rate when they are few, and that to
the training candidates' overall rate when the candidate is rare or unseen. Everything is counted
with numpy over flat (source, candidate) pair keys: no loop over visits.

`level="tag"` counts the same over the videos' tags (the visits' `video_tags`): transitions between
kinds of video, which recur across users where a pair of video ids rarely does.
"""
from __future__ import annotations

import numpy as np

from data.jagged import sorted_lookup
from model.baselines.base import COUNTED_LEVELS, PADDING, Visits, VisitScorer, check_level, items_at, require_labels

KEY_STRIDE = 1 << 31  # a (source, candidate) pair is the int64 key source x stride + candidate


class LastItemsMarkov(VisitScorer):
    name = "last-items Markov"

    def __init__(self, last_events: int = 5, shrinkage: float = 5.0, prior: float = 10.0, level: str = "video"):
        check_level(level, COUNTED_LEVELS)
        if last_events < 1:
            raise ValueError(f"last_events must be >= 1, got {last_events}")
        if not (shrinkage > 0 and prior > 0):
            raise ValueError(f"shrinkage and prior must be > 0, got {shrinkage} and {prior}")
        self.last_events, self.shrinkage, self.prior, self.level = last_events, shrinkage, prior, level

    def fit(self, train: Visits, holdout: Visits | None = None) -> LastItemsMarkov:
        labels = require_labels(train, "training").astype(np.float64)
        self.global_rate = labels.mean(axis=0)  # [T]
        self.videos, video_row = np.unique(self._items(train, train.candidate_videos), return_inverse=True)
        shown = np.bincount(video_row, minlength=len(self.videos)).astype(np.float64)
        positives = np.zeros((len(self.videos), labels.shape[1]))
        np.add.at(positives, video_row, labels)
        self.video_rate = (positives + self.prior * self.global_rate) / (shown + self.prior)[:, None]  # [V, T]

        keys, candidate = self._pair_keys(train)
        self.keys, key_row = np.unique(keys, return_inverse=True)
        self.shown = np.bincount(key_row, minlength=len(self.keys)).astype(np.float64)  # [K]
        self.positives = np.zeros((len(self.keys), labels.shape[1]))  # [K, T]
        np.add.at(self.positives, key_row, labels[candidate])
        return self

    def score(self, visits: Visits) -> np.ndarray:
        keys, candidate = self._pair_keys(visits)
        row, known = sorted_lookup(self.keys, keys)
        m, num_tasks = len(visits.candidate_videos), len(self.global_rate)
        shown = np.bincount(candidate[known], weights=self.shown[row[known]], minlength=m)  # [M]
        positives = np.zeros((m, num_tasks))
        np.add.at(positives, candidate[known], self.positives[row[known]])
        video, video_known = sorted_lookup(self.videos, self._items(visits, visits.candidate_videos))
        backoff = np.where(video_known[:, None], self.video_rate[video], self.global_rate)  # [M, T]
        return (positives + self.shrinkage * backoff) / (shown + self.shrinkage)[:, None]

    def _pair_keys(self, visits: Visits) -> tuple[np.ndarray, np.ndarray]:
        """-> ([P] key of each (history video, candidate) pair, [P] the candidate's row), over each
        visit's last `last_events` real (non-padding) history slots."""
        if self.last_events > visits.history_length:
            raise ValueError(f"last_events={self.last_events} but the visits carry {visits.history_length} "
                             "history events (build them with a longer history)")
        sources = self._items(visits, visits.history_videos[:, -self.last_events:])[visits.candidate_visit()]  # [M, k]
        candidates = self._items(visits, visits.candidate_videos)
        candidate = np.broadcast_to(np.arange(len(sources))[:, None], sources.shape)
        real = sources != PADDING
        sources, candidate = sources[real], candidate[real]
        if len(sources) and max(sources.max(), candidates.max()) >= KEY_STRIDE:
            raise ValueError(f"video ids must be < {KEY_STRIDE} to form pair keys")
        return sources * KEY_STRIDE + candidates[candidate], candidate

    def _items(self, visits: Visits, video_ids: np.ndarray) -> np.ndarray:
        """What the counts are over: the videos, or their tags."""
        return items_at(self.level, visits.video_tags, video_ids)
