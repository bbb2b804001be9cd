"""Count-based pair scorers: item popularity and a user-kNN collaborative filter (vectorised numpy).

A video or user absent from the training events has no counts: it scores 0, the count it has.
"""
from __future__ import annotations

import numpy as np

from data.jagged import sorted_lookup
from model.baselines.base import Interactions, PairScorer


class ItemPopularity(PairScorer):
    """Score = the video's count of positive training events for the task (0 for an unseen video)."""

    name = "item popularity"

    def fit(self, train: Interactions, holdout: Interactions | None = None) -> ItemPopularity:
        self.videos, inverse = np.unique(train.video_ids, return_inverse=True)
        self.positives = np.zeros((len(self.videos), train.num_tasks))
        np.add.at(self.positives, inverse, train.labels)
        return self

    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        row, known = sorted_lookup(self.videos, video_ids)
        out = np.zeros((len(video_ids), self.positives.shape[1]))
        out[known] = self.positives[row[known]]
        return out


class UserKNN(PairScorer):
    """User-based collaborative filtering on each task's positives (cosine similarity, k neighbours)."""

    name = "user-kNN collaborative filter"

    def __init__(self, neighbours: int = 20):
        if neighbours < 1:
            raise ValueError(f"neighbours must be >= 1, got {neighbours}")
        self.neighbours = neighbours

    def fit(self, train: Interactions, holdout: Interactions | None = None) -> UserKNN:
        self.users, user_row = np.unique(train.user_ids, return_inverse=True)
        self.videos, video_row = np.unique(train.video_ids, return_inverse=True)
        U, V, T = len(self.users), len(self.videos), train.num_tasks
        # Per task: positives [U, V] (dense over seen users/videos; fine at the sizes scored here).
        self.positives = np.zeros((T, U, V), dtype=np.float32)
        for t in range(T):
            np.add.at(self.positives[t], (user_row, video_row), train.labels[:, t])
        norms = np.linalg.norm(self.positives, axis=2, keepdims=True)  # [T, U, 1]
        unit = self.positives / np.maximum(norms, 1e-12)
        similarity = unit @ unit.transpose(0, 2, 1)  # [T, U, U]
        similarity[:, np.arange(U), np.arange(U)] = 0.0  # a user is not its own neighbour
        k = min(self.neighbours, max(U - 1, 1))
        kth = -np.sort(-similarity, axis=2)[:, :, k - 1 : k]  # [T, U, 1] the k-th largest similarity
        self.similarity = np.where(similarity >= kth, similarity, 0.0).astype(np.float32)
        return self

    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        """Sum over the user's neighbours of similarity x their positives."""
        u, u_known = sorted_lookup(self.users, user_ids)
        v, v_known = sorted_lookup(self.videos, video_ids)
        known = u_known & v_known
        out = np.zeros((len(user_ids), self.positives.shape[0]))
        for t in range(self.positives.shape[0]):
            # [M] = sum_w similarity[u_m, w] * positives[w, v_m]
            out[known, t] = np.einsum("mw,wm->m", self.similarity[t][u[known]], self.positives[t][:, v[known]])
        return out
