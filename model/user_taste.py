"""The candidate-only user-taste term: a learned user-id embedding against the candidate's video.

    taste[u, v, t] = user_bias[h(u), t] + Σ_f user_factors[h(u), f] · video_factors[h(v), f] · task_weights[f, t]

(h: id mod the table size.) This is what logistic matrix factorisation scores, added to each
candidate's logits next to `video_bias`. The sequence model can, in principle, read a user's taste
off the history, but on a small log that is slow to learn; a production ranker has a user-id
feature, and this is it. It reads only the candidate's (user, video) pair and is added after the
last layer, so no history token's K/V depends on it: cached and recomputed logits stay equal.
A user unseen in training reads an untrained row (zero bias, small random factors).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from model.config import HSTUConfig


class UserTaste(nn.Module):
    def __init__(self, config: HSTUConfig, device: torch.device | None = None):
        super().__init__()
        dim = config.user_factor_dim
        self.user_bias = nn.Embedding(config.user_hash_size, config.num_tasks, device=device)
        self.user_factors = nn.Embedding(config.user_hash_size, dim, device=device)
        self.video_factors = nn.Embedding(config.video_hash_size, dim, device=device)
        # Mixes the factor products into each task, so the tasks share one taste space.
        self.task_weights = nn.Parameter(torch.ones(dim, config.num_tasks, device=device))
        nn.init.zeros_(self.user_bias.weight)
        nn.init.normal_(self.user_factors.weight, std=0.1)
        nn.init.normal_(self.video_factors.weight, std=0.1)

    def tables(self) -> list[nn.Embedding]:
        """The per-id tables (trained sparsely: a step costs the rows it reads)."""
        return [self.user_bias, self.user_factors, self.video_factors]

    def forward(self, device_inputs: Mapping[str, Tensor]) -> Tensor:
        """-> [shape.candidate_rows, num_tasks]: each candidate row's taste logit (padding rows read row 0)."""
        users, videos = device_inputs["candidate_user_ids"], device_inputs["candidate_video_ids"]
        interaction = self.user_factors(users) * self.video_factors(videos)  # [M, F]
        return self.user_bias(users) + interaction @ self.task_weights

    def row_penalty(self, device_inputs: Mapping[str, Tensor]) -> Tensor:
        """Σ of the squared rows the batch's candidates read, averaged over candidates: an L2 on the
        touched rows only, so a row's decay follows how often it is seen, as in full-batch MF."""
        users, videos = device_inputs["candidate_user_ids"], device_inputs["candidate_video_ids"]
        rows = [self.user_factors(users), self.video_factors(videos), self.user_bias(users)]
        return sum(r.pow(2).sum(dim=-1) for r in rows).mean()
