"""The model's input for one batch of visits, in *event* coordinates, on the host.

A visit of user u carries the events `[start, start + history_length)` of u's history
that the model has to compute (everything before `start` is either cached or outside
the attention window), plus the visit's candidates. The model, not the data layer,
maps events to token positions (see model/token_layout.py).

Everything is numpy on the host: the model plans the batch there and moves what the
device needs in one copy (see model/staging.py). Jagged fields are flat `values` with
per-user `lengths`; offsets come from `data.jagged.offsets`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisitBatch:
    # --- one entry per visit (B visits, each of a different user); int64 ---
    request_ids: np.ndarray  # [B] (-1 for a request that is not in the dataset)
    user_ids: np.ndarray  # [B]
    request_times_ms: np.ndarray  # [B] time of the visit (its first candidate's time)
    window_starts: np.ndarray  # [B] event index where the user's attention window begins
    starts: np.ndarray  # [B] event index of the first carried event (>= window_starts)
    history_lengths: np.ndarray  # [B] number of carried events
    prev_timestamps_ms: np.ndarray  # [B] time of event start-1 (== time of event start when start == 0)
    user_features: np.ndarray  # [B, F] encoded user-feature ids (the contextual prefix)
    # --- jagged over carried events, sum(history_lengths) entries; int64 ---
    video_ids: np.ndarray  # [N]
    action_weights: np.ndarray  # [N] bit t = task t
    timestamps_ms: np.ndarray  # [N]
    # --- jagged over candidates, sum(candidate_lengths) entries ---
    candidate_lengths: np.ndarray  # [B] int64
    candidate_video_ids: np.ndarray  # [M] int64
    labels: np.ndarray | None  # [M, num_tasks] float32 (bit t of the candidate's action); None when unknown
    # [M, 3, 3] int64: the candidates' counting features, (user, video, user x video) x (shown,
    # clicks, long views) before the visit (data/candidate_counters.py); None = none known (all 0)
    candidate_counters: np.ndarray | None = None
    # Training targets drawn from the history itself (`InferenceDataset.make_batch(history_targets=)`)
    # see less than their visit's whole history: per candidate, the history end it sees (the event
    # index of the target: it sees the events before it) and its time. None: every candidate sees its
    # visit's history end and is scored at the request time (serving).
    candidate_history_ends: np.ndarray | None = None  # [M] int64
    candidate_times_ms: np.ndarray | None = None  # [M] int64

    @property
    def batch_size(self) -> int:
        return len(self.user_ids)

    @property
    def ends(self) -> np.ndarray:
        """[B] event index one past the last carried event (the visit's history end)."""
        return self.starts + self.history_lengths
