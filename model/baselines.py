"""Non-sequential baselines a ranking model must beat, fitted on the training period's events.

Each scorer learns from `Interactions` (every logged event before the split date: user, video,
its 8 action bits) and scores (user, video) pairs per task, higher = more likely:

    ItemPopularity        how many training events of the task's action the video has
    UserKNN               cosine user-user similarity of the task's positives; a pair scores the
                          similarity-weighted positives of the user's k nearest neighbours
    MatrixFactorization   logistic MF: per-task global, user and video biases plus user/video
                          factors, fitted by full-batch Adam on every training exposure,
                          early-stopped on the holdout pairs' click AUC

All are vectorised numpy / torch; none sees an event after the split date.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data.jagged import sorted_lookup
from model.metrics import SELECT_ON, auc, selection_score


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


class ItemPopularity:
    """Score = the video's count of positive training events for the task (0 for an unseen video)."""

    name = "item popularity"

    def fit(self, train: Interactions) -> ItemPopularity:
        self.videos, inverse = np.unique(train.video_ids, return_inverse=True)
        self.positives = np.zeros((len(self.videos), train.num_tasks))
        np.add.at(self.positives, inverse, train.labels)
        return self

    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        """-> [M, num_tasks] float64."""
        row, known = sorted_lookup(self.videos, video_ids)
        out = np.zeros((len(video_ids), self.positives.shape[1]))
        out[known] = self.positives[row[known]]
        return out


class UserKNN:
    """User-based collaborative filtering on each task's positives (cosine similarity, k neighbours)."""

    name = "user-kNN collaborative filter"

    def __init__(self, neighbours: int = 20):
        if neighbours < 1:
            raise ValueError(f"neighbours must be >= 1, got {neighbours}")
        self.neighbours = neighbours

    def fit(self, train: Interactions) -> UserKNN:
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
        """-> [M, num_tasks] float64: sum over the user's neighbours of similarity x their positives."""
        u, u_known = sorted_lookup(self.users, user_ids)
        v, v_known = sorted_lookup(self.videos, video_ids)
        known = u_known & v_known
        out = np.zeros((len(user_ids), self.positives.shape[0]))
        for t in range(self.positives.shape[0]):
            # [M] = sum_w similarity[u_m, w] * positives[w, v_m]
            out[known, t] = np.einsum("mw,wm->m", self.similarity[t][u[known]], self.positives[t][:, v[known]])
        return out


class _FactorModel(nn.Module):
    def __init__(self, num_users: int, num_videos: int, num_tasks: int, dim: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_tasks))
        self.user_bias = nn.Embedding(num_users + 1, num_tasks)  # last row: unseen users
        self.video_bias = nn.Embedding(num_videos + 1, num_tasks)
        self.user_factors = nn.Embedding(num_users + 1, dim)
        self.video_factors = nn.Embedding(num_videos + 1, dim)
        self.task_weights = nn.Parameter(torch.ones(dim, num_tasks))
        for table in (self.user_bias, self.video_bias):
            nn.init.zeros_(table.weight)
        for table in (self.user_factors, self.video_factors):
            nn.init.normal_(table.weight, std=0.1)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """-> [M, num_tasks] logits."""
        interaction = (self.user_factors(u) * self.video_factors(v)) @ self.task_weights
        return self.bias + self.user_bias(u) + self.video_bias(v) + interaction


class MatrixFactorization:
    """Logistic matrix factorisation of every training exposure's 8 labels (full-batch Adam, L2)."""

    name = "matrix factorisation"

    def __init__(self, dim: int = 16, steps: int = 200, learning_rate: float = 0.05, l2: float = 1e-4,
                 eval_every: int = 10, patience: int = 3, seed: int = 0, select_on: str = "click_auc"):
        if select_on not in SELECT_ON:
            raise ValueError(f"select_on must be loss or click_auc, got {select_on!r}")
        self.dim, self.steps, self.learning_rate, self.l2 = dim, steps, learning_rate, l2
        self.eval_every, self.patience, self.seed, self.select_on = eval_every, patience, seed, select_on

    def fit(self, train: Interactions, holdout: Interactions | None = None) -> MatrixFactorization:
        """Full-batch Adam on the mean BCE + l2 x (sum of squared parameters); with `holdout`, keep the
        parameters of the check (every `eval_every` steps) with the best holdout score: 1 - its click
        AUC (`select_on="click_auc"`, what the HSTU trainer selects on too) or its mean BCE ("loss").
        `holdout_scores` lists every check's (step, score)."""
        torch.manual_seed(self.seed)
        self.users = np.unique(train.user_ids)
        self.videos = np.unique(train.video_ids)
        self.model = _FactorModel(len(self.users), len(self.videos), train.num_tasks, self.dim)
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.learning_rate)
        u, v = self._rows(train.user_ids, train.video_ids)
        labels = torch.from_numpy(train.labels.astype(np.float32))
        best, best_state, bad = float("inf"), None, 0
        self.holdout_scores: list[tuple[int, float]] = []
        for step in range(1, self.steps + 1):
            self.model.train()
            loss = F.binary_cross_entropy_with_logits(self.model(u, v), labels)
            loss = loss + self.l2 * sum(p.pow(2).sum() for p in self.model.parameters())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if holdout is None or step % self.eval_every:
                continue
            score = self._holdout_score(holdout)
            self.holdout_scores.append((step, score))
            if score < best:
                best, best_state, bad = score, copy.deepcopy(self.model.state_dict()), 0
            else:
                bad += 1
                if bad >= self.patience:
                    break
        if best_state is not None:
            self.model.load_state_dict(best_state)
        return self

    def _holdout_score(self, holdout: Interactions) -> float:
        """Lower is better: 1 - the holdout's click AUC, or its mean BCE over every task."""
        with torch.no_grad():
            held = self._logits(holdout.user_ids, holdout.video_ids)
        loss = float(F.binary_cross_entropy_with_logits(held, torch.from_numpy(holdout.labels)))
        click_auc = auc(held[:, 0].numpy(), holdout.labels[:, 0]) if self.select_on == "click_auc" else None
        return selection_score(self.select_on, loss, click_auc,
                               "select matrix factorisation's checks on the loss instead (select_on='loss')")

    def score(self, user_ids: np.ndarray, video_ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self._logits(user_ids, video_ids).double().numpy()

    def _rows(self, user_ids: np.ndarray, video_ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding rows; an id unseen in training gets the shared last row (zero bias, untrained factors)."""
        u, u_known = sorted_lookup(self.users, user_ids)
        v, v_known = sorted_lookup(self.videos, video_ids)
        u = np.where(u_known, u, len(self.users))
        v = np.where(v_known, v, len(self.videos))
        return torch.from_numpy(u), torch.from_numpy(v)

    def _logits(self, user_ids: np.ndarray, video_ids: np.ndarray) -> torch.Tensor:
        self.model.eval()
        return self.model(*self._rows(user_ids, video_ids))
