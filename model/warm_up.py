"""Warm-up at node start: run every attention kernel variant the node can meet before it takes requests.

A Triton variant is compiled at its first launch (seconds), so a node that met one on a request would
stall every request of that batch. The variants are bounded (one per backend, dtype, head_dim and key
layout: `KernelVariant`, tests/model/test_kernel_variants.py), and the caller names the ways it serves:
through a cache of some layout (a node: its cache's), or without one (None: the replay's full
recompute). The warm-up runs two short visits per way (one starts a window, one continues it) through
the same `InferenceSession` path serving takes (CUDA graphs included, which also warms their capture),
on a private one-window cache of the same layout, so the caller's own cache, its host tiers and the
locality index never see the warm-up's user; the paged visits also compile the KV append kernel
(kvcache/triton_append.py) for the cache's dtype. On CPU it is the same path: the blocked backend's
first forwards (allocator, op dispatch) move out of the first request.

    report = warm_up(model, [cache.config], cuda_graphs=False)   # a node
    report.as_dict()   # what GET /health shows under "warm_up"
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data.user_histories import EventArrays, UserHistories
from kvcache import KVCacheConfig, KVCacheManager
from model.attention import KernelVariant, recording_variants
from model.inference import InferenceSession
from model.recommender import HSTURecommender
from model.visit import Visit

WARM_UP_USER = 0
WARM_UP_EVENTS = 2  # visit 1 starts a window, visit 2 continues it (cached keys + one new event)


@dataclass(frozen=True)
class WarmUpReport:
    variants: tuple[KernelVariant, ...]  # every variant the warm-up's forwards launched, sorted
    forwards: int  # warm-up visits scored
    seconds: float  # wall time of the warm-up, device work included
    backend: str  # the attention backend serving uses
    cuda_graphs: bool  # the warm-up went through the session's CUDA graphs

    def as_dict(self) -> dict[str, object]:
        return {"variants": [v.as_dict() for v in self.variants], "forwards": self.forwards,
                "seconds": round(self.seconds, 3), "backend": self.backend, "cuda_graphs": self.cuda_graphs}


def warm_up_history(model: HSTURecommender) -> UserHistories:
    """One user with WARM_UP_EVENTS events at times 1, 2, ... (video 0, no feature values)."""
    features = np.zeros((1, len(model.config.user_feature_cardinalities)), dtype=np.int64)
    n = WARM_UP_EVENTS
    ones = np.ones(n, dtype=np.int64)
    events = EventArrays(np.array([WARM_UP_USER]), np.array([0, n]), np.zeros(n, np.int64), ones,
                         np.arange(1, n + 1, dtype=np.int64), features)
    return UserHistories(events, "warm-up")


def private_cache_config(config: KVCacheConfig, max_seq_len: int) -> KVCacheConfig:
    """The node cache's layout (page size, dtype, device) with room for one window and no tier but memory."""
    return dataclasses.replace(
        config, num_pages=-(-max_seq_len // config.page_size) + 1, host_capacity_bytes=0, async_offload=False,
        persistent_dir=None, redis_url=None, redis_namespace="",
    )


def warm_up(model: HSTURecommender, serving: Sequence[KVCacheConfig | None], cuda_graphs: bool) -> WarmUpReport:
    """Score the warm-up visits each way the caller serves (`serving`: through a cache of each config's
    layout, or without a cache for None); returns what was warmed. Raises what a forward raises: a node
    that cannot run its kernels must not report ready."""
    started = time.perf_counter()
    history = warm_up_history(model)
    visits = [[Visit(WARM_UP_USER, t + 2, np.array([0]))] for t in range(WARM_UP_EVENTS)]  # events before t + 2
    forwards = 0
    with recording_variants() as met:
        for config in serving:
            cache = None if config is None else KVCacheManager(private_cache_config(config, model.config.max_seq_len))
            session = InferenceSession(model, history, kv_cache=cache, offload_between_visits=False,
                                       model_fingerprint="warm-up", cuda_graphs=cuda_graphs)
            try:
                for visit in visits:
                    session.score(visit)  # logits come back to the host: the device work is done
                    forwards += 1
            finally:
                if cache is not None:
                    cache.close()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return WarmUpReport(tuple(sorted(met)), forwards, time.perf_counter() - started,
                        model.resolved_attention_backend().name, cuda_graphs)
