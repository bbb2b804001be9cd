"""Replay visits in time order through an InferenceSession and compare two passes.

The end-to-end example (benchmark/inference_end2end_example.py) is a thin CLI over this
module: one pass with the KV cache, one with full recompute, then a request-by-request
logit comparison and a report.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from model.inference import InferenceSession
from model.metrics import per_task_auc


@dataclass(frozen=True)
class ReplayPass:
    name: str
    request_ids: np.ndarray  # [R] in serving order
    history_lengths: np.ndarray  # [R]
    request_latency_ms: np.ndarray  # [R] time of the batch that served each request
    batch_latency_ms: np.ndarray  # [num_batches]
    batch_history_lengths: np.ndarray  # [num_batches] history events summed over the batch's visits
    candidate_offsets: np.ndarray  # [R + 1] into logits / labels rows
    logits: np.ndarray  # [M, num_tasks]
    labels: np.ndarray  # [M, num_tasks]
    seconds: float  # total serving time (sum of batch times)
    tokens_computed: int
    tokens_reused: int

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    def latency_percentiles(self) -> dict[str, float]:
        lat = self.request_latency_ms
        return {f"p{q}": float(np.percentile(lat, q)) if lat.size else 0.0 for q in (50, 90, 99)}

    def auc(self, task_names: tuple[str, ...]) -> dict[str, float | None]:
        return per_task_auc(self.logits, self.labels, task_names)


@dataclass(frozen=True)
class ParityReport:
    max_abs_diff: float
    logit_scale: float  # max |logit| of the reference pass
    worst_request_id: int
    requests_compared: int

    def within(self, tolerance: float) -> bool:
        return self.max_abs_diff <= tolerance


def replay(session: InferenceSession, batches: list[np.ndarray], name: str, progress: bool = True) -> ReplayPass:
    request_ids, histories, latencies, cand_lengths, logits, labels = [], [], [], [], [], []
    batch_ms, batch_history = [], []
    computed = reused = 0
    total = 0.0
    for i, idx in enumerate(tqdm(batches, desc=f"replay ({name})", disable=not progress, file=sys.stderr, unit="batch")):
        started = time.perf_counter()
        result = session.serve(idx, next_request_indices=batches[i + 1] if i + 1 < len(batches) else None)
        elapsed = time.perf_counter() - started
        total += elapsed
        request_ids.append(result.request_ids)
        histories.append(result.history_lengths)
        latencies.append(np.full(len(idx), elapsed * 1000.0))
        batch_ms.append(elapsed * 1000.0)
        batch_history.append(int(result.history_lengths.sum()))
        cand_lengths.append(result.candidate_lengths)
        logits.append(result.logits)
        labels.append(result.labels)
        computed += result.tokens_computed
        reused += result.tokens_reused
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    cand = cat(cand_lengths).astype(np.int64)
    return ReplayPass(
        name=name,
        request_ids=cat(request_ids),
        history_lengths=cat(histories),
        request_latency_ms=cat(latencies).astype(np.float64),
        batch_latency_ms=np.asarray(batch_ms, dtype=np.float64),
        batch_history_lengths=np.asarray(batch_history, dtype=np.int64),
        candidate_offsets=np.concatenate([[0], np.cumsum(cand)]),
        logits=torch.cat(logits).numpy() if logits else np.zeros((0, 0), np.float32),
        labels=torch.cat(labels).numpy() if labels else np.zeros((0, 0), np.float32),
        seconds=total,
        tokens_computed=computed,
        tokens_reused=reused,
    )


def compare(candidate: ReplayPass, reference: ReplayPass) -> ParityReport:
    """Request-by-request comparison of two passes over the same requests."""
    if not np.array_equal(candidate.request_ids, reference.request_ids):
        raise ValueError("The two passes served different requests (or in a different order)")
    if not np.array_equal(candidate.candidate_offsets, reference.candidate_offsets):
        raise ValueError("The two passes scored different candidate counts")
    if candidate.logits.size == 0:
        return ParityReport(0.0, 0.0, -1, candidate.num_requests)
    diff = np.abs(candidate.logits - reference.logits).max(axis=1)  # [M]
    worst_row = int(np.argmax(diff))
    worst_request = int(np.searchsorted(candidate.candidate_offsets, worst_row, side="right") - 1)
    return ParityReport(
        max_abs_diff=float(diff.max()),
        logit_scale=float(np.abs(reference.logits).max()),
        worst_request_id=int(candidate.request_ids[worst_request]),
        requests_compared=candidate.num_requests,
    )
