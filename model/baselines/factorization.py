"""Logistic matrix factorisation of the training exposures' labels, with an exposure objective.

Per task: global + user + video biases + (user factors * video factors) @ task weights, fitted by
full-batch Adam on the mean BCE of every training exposure's 8 labels, early-stopped on the holdout's
click AUC (`model.metrics.selection_score`, the rule the HSTU's epochs are picked by).

Why the exposure objective: a video is seen about twice in the demo's training period, so the one or
two labels of its sightings are all a labels-only fit learns its factors from; it memorises them
(training click AUC 0.9+, holdout 0.53 on item-taste data) whatever the init, L2, rate or checks.
What does reveal a video's kind is who it was shown to: the logged policy shows users what they like.
With `exposure_weight` > 0 the same factors also learn to tell the logged (user, video) pairs from
random ones (a user and a video of two random training rows: the same marginals), so a video's
factors are pulled toward its audience's. docs/model.md ("Quality against baselines") has the figures.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data.jagged import sorted_lookup
from model.baselines.base import Interactions, PairScorer
from model.evaluation import EarlyStopping
from model.metrics import SELECT_ON, auc, selection_score

UNSEEN = -1  # embedding row of an id absent from the training events


def _lookup(table: nn.Embedding, rows: torch.Tensor) -> torch.Tensor:
    """Rows of `table`; an unseen id (UNSEEN) reads the mean row: the average user or video."""
    out = table(rows.clamp(min=0))
    unseen = rows == UNSEEN
    return torch.where(unseen[:, None], table.weight.mean(0), out) if bool(unseen.any()) else out


class _FactorModel(nn.Module):
    def __init__(self, num_users: int, num_videos: int, num_tasks: int, dim: int, init_std: float):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(num_tasks))
        self.user_bias = nn.Embedding(num_users, num_tasks)
        self.video_bias = nn.Embedding(num_videos, num_tasks)
        self.user_factors = nn.Embedding(num_users, dim)
        self.video_factors = nn.Embedding(num_videos, dim)
        self.task_weights = nn.Parameter(torch.ones(dim, num_tasks))
        # The exposure logit: no biases, as the random pairs share the logged pairs' user and video marginals.
        self.exposure_bias = nn.Parameter(torch.zeros(()))
        self.exposure_weights = nn.Parameter(torch.ones(dim))
        for table in (self.user_bias, self.video_bias):
            nn.init.zeros_(table.weight)
        for table in (self.user_factors, self.video_factors):
            nn.init.normal_(table.weight, std=init_std)

    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """-> [M, num_tasks] logits."""
        interaction = (_lookup(self.user_factors, u) * _lookup(self.video_factors, v)) @ self.task_weights
        return self.bias + _lookup(self.user_bias, u) + _lookup(self.video_bias, v) + interaction

    def exposure_logits(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """-> [M] logit that (u, v) is a logged exposure rather than a random pair."""
        return self.exposure_bias + (self.user_factors(u) * self.video_factors(v)) @ self.exposure_weights


class MatrixFactorization(PairScorer):
    """Logistic matrix factorisation of every training exposure's 8 labels (full-batch Adam, L2)."""

    name = "matrix factorisation"
    stops_on_holdout = True

    def __init__(self, dim: int = 16, steps: int = 200, learning_rate: float = 0.05, l2: float = 1e-4,
                 exposure_weight: float = 0.0, init_std: float = 0.1, eval_every: int = 10, patience: int = 3,
                 seed: int = 0, select_on: str = "click_auc"):
        if select_on not in SELECT_ON:
            raise ValueError(f"select_on must be loss or click_auc, got {select_on!r}")
        if exposure_weight < 0:
            raise ValueError(f"exposure_weight must be >= 0, got {exposure_weight}")
        self.dim, self.steps, self.learning_rate, self.l2 = dim, steps, learning_rate, l2
        self.exposure_weight, self.init_std = exposure_weight, init_std
        self.eval_every, self.patience, self.seed, self.select_on = eval_every, patience, seed, select_on
        self.kept_step = steps

    def fit(self, train: Interactions, holdout: Interactions | None = None) -> MatrixFactorization:
        """Full-batch Adam on the mean BCE (+ exposure_weight x the exposure BCE) + l2 x (sum of squared
        parameters); with `holdout`, keep the parameters of the check (every `eval_every` steps) with the
        best holdout score: 1 - its click AUC (`select_on="click_auc"`) or its mean BCE ("loss").
        `holdout_scores` lists every check's (step, score); `kept_step` is the kept check's step."""
        torch.manual_seed(self.seed)
        generator = torch.Generator().manual_seed(self.seed)
        self.users = np.unique(train.user_ids)
        self.videos = np.unique(train.video_ids)
        self.model = _FactorModel(len(self.users), len(self.videos), train.num_tasks, self.dim, self.init_std)
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.learning_rate)
        u, v = self._rows(train.user_ids, train.video_ids)
        labels = torch.from_numpy(train.labels.astype(np.float32))
        stopping = EarlyStopping(self.patience)  # the trainer's: keeps the best check's parameters
        self.holdout_scores: list[tuple[int, float]] = []
        for step in range(1, self.steps + 1):
            self.model.train()
            loss = F.binary_cross_entropy_with_logits(self.model(u, v), labels)
            if self.exposure_weight:
                loss = loss + self.exposure_weight * self._exposure_loss(u, v, generator)
            loss = loss + self.l2 * sum(p.pow(2).sum() for p in self.model.parameters())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if holdout is None or step % self.eval_every:
                continue
            score = self._holdout_score(holdout)
            self.holdout_scores.append((step, score))
            if stopping.update(step, score, self.model):
                break
        stopping.restore_best(self.model)
        self.kept_step = stopping.best_epoch if self.holdout_scores else self.steps
        return self

    def picked(self) -> dict[str, object]:
        return {"steps": self.kept_step}

    def _exposure_loss(self, u: torch.Tensor, v: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Mean BCE of the logged pairs (1) against as many random ones (0): a training row's user with
        another random row's video, redrawn every step."""
        n = len(u)
        random_u = u[torch.randint(n, (n,), generator=generator)]
        random_v = v[torch.randint(n, (n,), generator=generator)]
        logits = self.model.exposure_logits(torch.cat([u, random_u]), torch.cat([v, random_v]))
        target = torch.cat([torch.ones(n), torch.zeros(n)])
        return F.binary_cross_entropy_with_logits(logits, target)

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
        """Embedding rows; UNSEEN for an id absent from the training events."""
        u, u_known = sorted_lookup(self.users, user_ids)
        v, v_known = sorted_lookup(self.videos, video_ids)
        return torch.from_numpy(np.where(u_known, u, UNSEEN)), torch.from_numpy(np.where(v_known, v, UNSEEN))

    def _logits(self, user_ids: np.ndarray, video_ids: np.ndarray) -> torch.Tensor:
        self.model.eval()
        return self.model(*self._rows(user_ids, video_ids))
