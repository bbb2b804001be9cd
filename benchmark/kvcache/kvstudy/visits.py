"""A visit's latency and memory with the KV cache, by full recompute, and for its history alone.

For each history length L, one user (batch 1) with L history tokens and `candidates` candidates:
  * full:    every history token and the candidates, nothing cached;
  * prefill: the L history tokens alone, nothing cached: what a miss costs before scoring, and
             what a reload from a tier replaces;
  * cached:  all but the last `new` history tokens in the paged KV cache: the new tokens and the
             candidates (hstu_block_benchmark's cached path); `new` is at most half the history.
The share of a full visit spent on the history is prefill / full; the rest is the candidates'
(their projections and their attention over the whole history). A first untimed round measures
the full and the cached visit's peak memory (device_profile.peak_memory_bytes) and warms them
up; then `repeats` interleaved timed rounds, or LONG_ROUNDS for histories above `long_history` (a full recompute there
takes tens of seconds on a CPU, and a round that long is its own warm-up). Shares and speedups are
medians of the per-round ratios: the paths of one round ran under the same load. The history alone is not
memory-profiled: the cache replaces it, its memory is not what a served user holds. The cached
visit's peak is also measured at batch `memory_batch`: part of a visit's working memory is the
batch's (the CPU attention's score chunk, bias tables), the rest grows with its users.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from tqdm import tqdm

from benchmark.device_profile import peak_memory_bytes
from benchmark.model.hstu_block import timed_rounds, visit_fns
from model.recommender import HSTURecommender


@dataclass(frozen=True)
class VisitRow:
    history: int
    new_tokens: int  # of the cached visit
    rounds: int  # timed rounds behind the medians
    full_ms: float
    prefill_ms: float
    cached_ms: float
    history_share: float  # prefill / full (median of the rounds'): the part of a full visit spent on the history
    speedup: float  # full / cached (median of the rounds')
    full_peak_bytes: int  # peak memory the visit allocates above what was allocated before it
    cached_peak_bytes: int
    memory_batch: int  # a second batch size whose cached visit's peak memory is measured
    cached_peak_bytes_batch: int  # ... that peak: with batch 1's, it splits per-user from per-batch memory
    kv_bytes: int  # the user's K/V pages on the device during the cached visit


LONG_ROUNDS = 2


def rounds_for(history: int, repeats: int, long_history: int) -> int:
    return min(LONG_ROUNDS, repeats) if history > long_history else repeats


def cached_peak_at_batch(model: HSTURecommender, history: int, new: int, candidates: int, batch: int,
                         device: torch.device) -> int:
    fns = visit_fns(model, history, batch, new, candidates, device)
    with torch.inference_mode():
        return peak_memory_bytes(fns.cached, device)


def measure_history(model: HSTURecommender, history: int, new: int, candidates: int, repeats: int,
                    long_history: int, memory_batch: int, device: torch.device) -> VisitRow:
    new = min(new, max(history // 2, 1))
    fns = visit_fns(model, history, 1, new, candidates, device)
    rounds = rounds_for(history, repeats, long_history)
    with torch.inference_mode():
        full_peak = peak_memory_bytes(fns.full, device)  # also warms the path up
        cached_peak = peak_memory_bytes(fns.cached, device)
        if history <= long_history:  # a long round is its own warm-up
            fns.prefill()
        full, prefill, cached = timed_rounds([fns.full, fns.prefill, fns.cached], rounds, warmup=False)
    share = statistics.median(p / f for p, f in zip(prefill, full))
    speedup = statistics.median(f / c for f, c in zip(full, cached))
    ms = [statistics.median(s) * 1e3 for s in (full, prefill, cached)]
    return VisitRow(history, new, rounds, *ms, share, speedup, full_peak, cached_peak, memory_batch,
                    cached_peak_at_batch(model, history, new, candidates, memory_batch, device), fns.kv_nbytes)


def measure_visits(model: HSTURecommender, histories: list[int], new: int, candidates: int, repeats: int,
                   long_history: int, memory_batch: int, device: torch.device) -> list[VisitRow]:
    rows = []
    for history in tqdm(histories, desc="visits: history lengths", leave=False):
        rows.append(measure_history(model, history, new, candidates, repeats, long_history, memory_batch, device))
    return rows
