"""The candidate-only counter term: what the log says about the user, the video and the pair.

For each counter family f (`data.candidate_counters.FAMILIES`: the user's own history, every
user's events of the candidate's video, the user's earlier events of this video) the batch carries
(shown n, clicks, long views) before the visit. The term reads them as

    b_f   = min(floor(log2(1 + n_f)), K - 1)                  how much evidence there is
    l_fk  = log((positives_fk + 1) / (n_f - positives_fk + 1))  the smoothed log-odds of action k
    term[t] = sum_f  offset[f, b_f, t] + sum_k slope[f, b_f, k, t] * l_fk

with K = `config.counter_buckets`: per-task offsets and slopes that depend on the amount of
evidence, so the model learns how far to trust a rate seen 1 or 1000 times (the shrinkage a
Bayesian average would hard-code). Zero-initialised. Why it exists: the sequence model reads a
window of the user's history, and a video's own rows are learnt only from the few times it is a
training candidate; these counters hand it the user's whole record, every other user's record of
the video, and "seen / clicked before" directly. Added after the head, candidates only: nothing
cached depends on it.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn

from data.candidate_counters import FAMILIES
from data.schema import COUNTED_TASKS
from model.config import HSTUConfig


def counter_inputs(counters: np.ndarray | None, candidate_rows: int, buckets: int) -> dict[str, np.ndarray]:
    """[M, F, 1 + K] counts -> the term's host arrays over `candidate_rows` rows (padding and a batch
    without counters read bucket 0 and log-odds 0): buckets [rows, F] int64, log_odds [rows, F, K] float32."""
    out_buckets = np.zeros((candidate_rows, len(FAMILIES)), dtype=np.int64)
    out_log_odds = np.zeros((candidate_rows, len(FAMILIES), len(COUNTED_TASKS)), dtype=np.float32)
    if counters is not None and buckets:
        counts = np.asarray(counters, dtype=np.int64)
        shown, positives = counts[:, :, :1], counts[:, :, 1:]
        out_buckets[: len(counts)] = np.minimum(np.floor(np.log2(1.0 + shown[:, :, 0])), buckets - 1)
        out_log_odds[: len(counts)] = np.log((positives + 1.0) / (shown - positives + 1.0))
    return {"candidate_counter_buckets": out_buckets, "candidate_counter_log_odds": out_log_odds}


class CounterFeatures(nn.Module):
    def __init__(self, config: HSTUConfig, device: torch.device | None = None):
        super().__init__()
        families, buckets, tasks = len(FAMILIES), config.counter_buckets, config.num_tasks
        self.offsets = nn.Parameter(torch.zeros(families, buckets, tasks, device=device))
        self.slopes = nn.Parameter(torch.zeros(families, buckets, len(COUNTED_TASKS), tasks, device=device))

    def forward(self, device_inputs: Mapping[str, Tensor]) -> Tensor:
        """-> [shape.candidate_rows, num_tasks]: each candidate row's counter logit."""
        buckets = device_inputs["candidate_counter_buckets"]  # [M, F]
        log_odds = device_inputs["candidate_counter_log_odds"]  # [M, F, K]
        family = torch.arange(buckets.shape[1], device=buckets.device)
        offsets = self.offsets[family, buckets]  # [M, F, T]
        slopes = self.slopes[family, buckets]  # [M, F, K, T]
        return offsets.sum(1) + (slopes * log_odds.unsqueeze(-1)).sum((1, 2))
