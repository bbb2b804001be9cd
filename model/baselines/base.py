"""What a baseline learns from and what it answers: the two input types and the two scorer contracts.

    Interactions    logged events as (user, video, 8 action bits) rows: what the pair scorers fit on
    Visits          visits as (the user's last events before the visit, its candidates): what the
                    sequential scorers fit on and score; built from the dataset's event arrays
    PairScorer      fit(Interactions) -> score(user_ids, video_ids)
    VisitScorer     fit(Visits) -> score(Visits without labels)

Every score is [M, num_tasks] float64, higher = more likely, one row per candidate in the order asked.
A scorer whose fit stops on the holdout (`stops_on_holdout`: it keeps its best check or epoch) says
what it kept in `picked()`; the tuner keeps that fit, as the HSTU trainer keeps its best holdout epoch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from data import jagged
from data.dataset import EventArrays
from data.requests import RequestTable
from data.schema import action_labels
from model.video_tags import VideoTagTable

PADDING = -1  # video id of an empty history slot (visits are left-padded: the last slot is the latest event)


@dataclass(frozen=True)
class Interactions:
    """Logged events ([N] rows): who saw what, and which actions followed."""

    user_ids: np.ndarray  # [N] int64
    video_ids: np.ndarray  # [N] int64
    labels: np.ndarray  # [N, num_tasks] float32 0/1

    def __post_init__(self) -> None:
        n = len(self.user_ids)
        if len(self.video_ids) != n or self.labels.ndim != 2 or len(self.labels) != n:
            raise ValueError(f"Interactions: user_ids [{n}], video_ids [{len(self.video_ids)}] and labels "
                             f"{tuple(self.labels.shape)} must have one row per event")

    @property
    def num_tasks(self) -> int:
        return self.labels.shape[1]


@dataclass(frozen=True)
class Visits:
    """B visits: each one's last `history_events` events before it (left-padded with PADDING) and its
    candidates, flat in visit order. `labels` are the candidates' action bits, None where the
    candidates are to be scored: a scorer given unlabelled visits cannot read what it predicts.
    `video_tags` is the catalogue's tag table when the data has one (what the HSTU's `--video_tags`
    reads): a scorer may read each video's tag from it (`items_at`), as the HSTU may."""

    user_ids: np.ndarray  # [B]
    history_videos: np.ndarray  # [B, L] int64, PADDING before the user's first event
    history_actions: np.ndarray  # [B, L] int64 action weights (0 in padding)
    candidate_offsets: np.ndarray  # [B + 1] visit b's candidates are [offsets[b], offsets[b + 1])
    candidate_videos: np.ndarray  # [M]
    labels: np.ndarray | None  # [M, num_tasks] float32, or None
    video_tags: VideoTagTable | None = None

    def __post_init__(self) -> None:
        b, m = len(self.user_ids), len(self.candidate_videos)
        if self.history_videos.shape != self.history_actions.shape or len(self.history_videos) != b:
            raise ValueError(f"Visits: {b} visits but histories of shape {self.history_videos.shape} "
                             f"and actions {self.history_actions.shape}")
        if len(self.candidate_offsets) != b + 1 or self.candidate_offsets[-1] != m:
            raise ValueError(f"Visits: candidate_offsets must be [{b + 1}] ending at {m} candidates")
        if self.labels is not None and len(self.labels) != m:
            raise ValueError(f"Visits: labels {self.labels.shape} for {m} candidates")

    @classmethod
    def build(cls, events: EventArrays, requests: RequestTable, indices: np.ndarray, history_events: int,
              with_labels: bool, video_tags: VideoTagTable | None = None) -> Visits:
        """Visits `indices` of `requests` over the dataset's event arrays: each visit's history is the
        last `history_events` of its user's events before the visit's first one (`end`), whatever the
        period they fall in; its candidates are the request's candidates."""
        if history_events < 1:
            raise ValueError(f"history_events must be >= 1, got {history_events}")
        indices = np.asarray(indices, dtype=np.int64)
        rows = np.searchsorted(events.user_ids, requests.user_id[indices])
        end, num_candidates = requests.end[indices], requests.num_candidates[indices]
        length = np.minimum(end, history_events)
        visit, rank = jagged.row_ids_and_ranks(length)
        flat = jagged.range_indices(events.offsets[rows] + end - length, length)
        slot = history_events - length[visit] + rank  # right-aligned: the latest event in the last slot
        videos = np.full((len(indices), history_events), PADDING, dtype=np.int64)
        actions = np.zeros((len(indices), history_events), dtype=np.int64)
        videos[visit, slot] = events.video_ids[flat]
        actions[visit, slot] = events.action_weights[flat]
        candidates = jagged.range_indices(events.offsets[rows] + end, num_candidates)
        labels = action_labels(events.action_weights[candidates]) if with_labels else None
        return cls(requests.user_id[indices], videos, actions, jagged.offsets(num_candidates),
                   events.video_ids[candidates], labels, video_tags)

    def __len__(self) -> int:
        return len(self.user_ids)

    @property
    def history_length(self) -> int:
        return self.history_videos.shape[1]

    def candidate_visit(self) -> np.ndarray:
        """[M] the visit (row) each candidate belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.candidate_offsets))

    def unlabelled(self) -> Visits:
        return Visits(self.user_ids, self.history_videos, self.history_actions, self.candidate_offsets,
                      self.candidate_videos, None, self.video_tags)

    def select(self, rows: np.ndarray) -> Visits:
        """The visits `rows` (in that order), with their candidates."""
        rows = np.asarray(rows, dtype=np.int64)
        counts = np.diff(self.candidate_offsets)[rows]
        flat = jagged.range_indices(self.candidate_offsets[rows], counts)
        return Visits(self.user_ids[rows], self.history_videos[rows], self.history_actions[rows],
                      jagged.offsets(counts), self.candidate_videos[flat],
                      None if self.labels is None else self.labels[flat], self.video_tags)


BOTH = "both"
# What a sequential baseline counts or embeds: each video, its tag, or (SASRec) the id and the tag together.
LEVELS = ("video", "tag", BOTH)


COUNTED_LEVELS = ("video", "tag")  # what a counting baseline can count: an item is one id


def check_level(level: str, allowed: tuple[str, ...] = LEVELS) -> None:
    if level not in allowed:
        raise ValueError(f"level must be one of {', '.join(map(repr, allowed))}, got {level!r}")


def items_at(level: str, video_tags: VideoTagTable | None, video_ids: np.ndarray) -> np.ndarray:
    """The videos (level "video") or their tag rows (level "tag"), PADDING kept."""
    return video_ids if level == "video" else tag_rows(video_tags, video_ids)


def tag_rows(video_tags: VideoTagTable | None, video_ids: np.ndarray) -> np.ndarray:
    """Each video's tag row in `video_tags` (0 for a video without one), PADDING kept as is."""
    if video_tags is None:
        raise ValueError("these visits carry no video tag table (the data has no video tags)")
    return np.where(video_ids == PADDING, PADDING, video_tags.rows(video_ids.ravel()).reshape(video_ids.shape))


def require_labels(visits: Visits, role: str) -> np.ndarray:
    if visits.labels is None:
        raise ValueError(f"{role} visits need their candidates' labels (Visits.build(..., with_labels=True))")
    return visits.labels


class PairScorer(ABC):
    """Scores (user, video) pairs from what it learnt of logged events."""

    name: ClassVar[str]

    @abstractmethod
    def fit(self, train: Interactions, holdout: Interactions | None = None) -> PairScorer:
        """Learn from `train`; a scorer that picks an iteration count uses `holdout` to do so."""

    @abstractmethod
    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        """-> [M, num_tasks] float64."""

    stops_on_holdout: ClassVar[bool] = False

    def picked(self) -> dict[str, object]:
        """What the fit picked from the holdout (a step or epoch count), reported beside the grid point."""
        return {}


class VisitScorer(ABC):
    """Scores each visit's candidates from the user's events before the visit."""

    name: ClassVar[str]

    @abstractmethod
    def fit(self, train: Visits, holdout: Visits | None = None) -> VisitScorer:
        """Learn from labelled `train` visits; one that picks an epoch count uses labelled `holdout` visits."""

    @abstractmethod
    def score(self, visits: Visits) -> np.ndarray:
        """-> [M, num_tasks] float64 for `visits`' candidates, in order (their labels are not read)."""

    stops_on_holdout: ClassVar[bool] = False

    def picked(self) -> dict[str, object]:
        """What the fit picked from the holdout (a step or epoch count), reported beside the grid point."""
        return {}
