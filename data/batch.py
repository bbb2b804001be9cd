"""The model's input for one batch of visits, in *event* coordinates.

A visit of user u carries the events `[start, start + history_length)` of u's history
that the model has to compute (everything before `start` is either cached or outside
the attention window), plus the visit's candidates. The model, not the data layer,
maps events to token positions (see model/token_layout.py).

Jagged fields are stored as flat `values` with per-user `lengths`; offsets are derived
with `data.jagged.offsets_from_lengths` (the one place for that bookkeeping).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class VisitBatch:
    # --- one entry per visit (B visits, each of a different user) ---
    request_ids: torch.Tensor  # [B] int64
    user_ids: torch.Tensor  # [B] int64
    request_times_ms: torch.Tensor  # [B] int64, time of the visit (its first candidate's time)
    window_starts: torch.Tensor  # [B] int64, event index where the user's attention window begins
    starts: torch.Tensor  # [B] int64, event index of the first carried event (>= window_starts)
    history_lengths: torch.Tensor  # [B] int64, number of carried events
    prev_timestamps_ms: torch.Tensor  # [B] int64, time of event start-1 (== time of event start when start == 0)
    user_features: torch.Tensor  # [B, F] int64, encoded user-feature ids (the contextual prefix)
    # --- jagged over carried events, sum(history_lengths) entries ---
    video_ids: torch.Tensor  # [N] int64
    action_weights: torch.Tensor  # [N] int64, bit t = task t
    timestamps_ms: torch.Tensor  # [N] int64
    # --- jagged over candidates, sum(candidate_lengths) entries ---
    candidate_lengths: torch.Tensor  # [B] int64
    candidate_video_ids: torch.Tensor  # [M] int64
    labels: torch.Tensor  # [M, num_tasks] float32, bit t of the candidate's action_weights

    @property
    def batch_size(self) -> int:
        return int(self.user_ids.numel())

    @property
    def ends(self) -> torch.Tensor:
        """[B] event index one past the last carried event (the visit's history end)."""
        return self.starts + self.history_lengths

    def to(self, device: torch.device | str) -> VisitBatch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})
