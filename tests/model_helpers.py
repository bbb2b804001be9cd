"""In-memory user histories and VisitBatch construction for model tests.

Independent of the preprocessed-data layer on purpose: model tests state exactly which
events each visit carries, so a failure points at the model or the cache, not the data.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from data.batch import VisitBatch
from model.config import HSTUConfig, preset

NUM_TASKS = 8


@dataclass
class History:
    video_ids: np.ndarray
    action_weights: np.ndarray
    timestamps_ms: np.ndarray
    user_features: np.ndarray  # [F]


@dataclass
class Visit:
    user_id: int
    end: int  # history events [0, end) exist at this visit
    candidates: np.ndarray  # video ids
    window_start: int = 0
    start: int = 0  # first event carried in the batch


def tiny_config(**overrides) -> HSTUConfig:
    overrides.setdefault("user_feature_cardinalities", (3, 5, 4))
    return preset("tiny", **overrides)


def random_histories(rng: np.random.Generator, num_users: int, length: int | tuple[int, int],
                     config: HSTUConfig, first_user: int = 0) -> dict[int, History]:
    histories = {}
    for u in range(first_user, first_user + num_users):
        n = length if isinstance(length, int) else int(rng.integers(length[0], length[1] + 1))
        gaps = rng.choice([0, 1_000, 30_000, 600_000, 7_200_000], size=n)
        histories[u] = History(
            video_ids=rng.integers(0, 50_000, size=n),
            action_weights=rng.integers(0, 256, size=n),
            timestamps_ms=1_649_376_000_000 + np.cumsum(gaps),
            user_features=np.array([rng.integers(0, c) for c in config.user_feature_cardinalities] or [0]),
        )
    return histories


def random_candidates(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(0, 50_000, size=count)


def make_batch(histories: dict[int, History], visits: list[Visit]) -> VisitBatch:
    def cat(parts, dtype=torch.int64):
        return torch.as_tensor(np.concatenate(parts) if parts else np.zeros(0), dtype=dtype)

    hists = [histories[v.user_id] for v in visits]
    prev = []
    for v, h in zip(visits, hists):
        prev.append(h.timestamps_ms[v.start - 1] if v.start > 0 else h.timestamps_ms[min(v.start, len(h.timestamps_ms) - 1)])
    request_times = [h.timestamps_ms[v.end - 1] + 60_000 for v, h in zip(visits, hists)]
    labels = []
    for v in visits:  # deterministic labels from the candidate ids
        bits = (v.candidates[:, None] >> np.arange(NUM_TASKS)) & 1
        labels.append(bits.astype(np.float32))
    return VisitBatch(
        request_ids=torch.arange(len(visits)),
        user_ids=torch.tensor([v.user_id for v in visits]),
        request_times_ms=torch.tensor(request_times),
        window_starts=torch.tensor([v.window_start for v in visits]),
        starts=torch.tensor([v.start for v in visits]),
        history_lengths=torch.tensor([v.end - v.start for v in visits]),
        prev_timestamps_ms=torch.tensor(prev, dtype=torch.int64),
        user_features=torch.as_tensor(np.stack([h.user_features for h in hists]), dtype=torch.int64),
        video_ids=cat([h.video_ids[v.start:v.end] for v, h in zip(visits, hists)]),
        action_weights=cat([h.action_weights[v.start:v.end] for v, h in zip(visits, hists)]),
        timestamps_ms=cat([h.timestamps_ms[v.start:v.end] for v, h in zip(visits, hists)]),
        candidate_lengths=torch.tensor([len(v.candidates) for v in visits]),
        candidate_video_ids=cat([v.candidates for v in visits]),
        labels=cat(labels, torch.float32).reshape(-1, NUM_TASKS),
    )


def serve(model, kv_cache, histories: dict[int, History], visits: list[Visit]) -> torch.Tensor:
    """Serve visits as InferenceSession does: plan against the cache (None: full recompute),
    carry only the events to compute, forward. -> logits [M, num_tasks]"""
    from model.inference import plan_visits

    users = np.array([v.user_id for v in visits])
    ends = np.array([v.end for v in visits])
    plan = plan_visits(model.layout, kv_cache, users, ends)
    planned = [Visit(v.user_id, v.end, v.candidates, int(w), int(s))
               for v, w, s in zip(visits, plan.window_starts, plan.starts)]
    with torch.inference_mode():
        return model(make_batch(histories, planned), kv_cache)


def make_cache(config: HSTUConfig, num_pages: int = 256, page_size: int | None = None,
               host_capacity_bytes: int = 1 << 30, dtype: torch.dtype = torch.float32, **kwargs):
    from kvcache import KVCacheConfig, KVCacheManager

    return KVCacheManager(KVCacheConfig(
        num_layers=config.num_layers, num_heads=config.num_heads, head_dim=config.head_dim,
        page_size=page_size or config.page_size, num_pages=num_pages, dtype=dtype,
        host_capacity_bytes=host_capacity_bytes, **kwargs,
    ))


def assert_logits_close(cached: torch.Tensor, full: torch.Tensor, rel: float = 1e-5) -> None:
    scale = max(1.0, float(full.abs().max()))
    diff = float((cached - full).abs().max()) if full.numel() else 0.0
    assert diff <= rel * scale, f"max |cached - full| = {diff:.3g} > {rel:g} x scale {scale:.3g}"
