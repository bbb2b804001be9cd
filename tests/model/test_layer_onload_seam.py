"""The model waits for an onloaded layer right before it uses it: the tokens' times first (they come
with layer 0), then layer l asks the cache for layer l's pages (where the manager makes compute
wait for that layer's onload) only once layers < l have appended theirs, and the logits of visits
onloaded from any tier equal a full recompute."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import (
    Visit,
    assert_logits_close,
    random_candidates,
    random_histories,
    sensitive_model,
    serve,
    tiny_config,
    unique_namespace,
)
from kvcache import (
    DiskHostStorage,
    InMemoryHostStorage,
    KVCacheManager,
    TieredHostStorage,
)
from kvcache.storage.redis_tier import RedisHostStorage
from model.cache_config import kv_cache_config
from model.kv_store import PagedKV

UNWRITTEN = 12345.0  # put into the new tokens' K slots before the forward; an append overwrites it


class LayerReadinessLog:
    """Stands between `PagedKV` and the cache: records each layer the forward asks pages for, and which
    layers had appended their new tokens' K at that moment."""

    def __init__(self, cache: KVCacheManager, new_token_slots: torch.Tensor) -> None:
        self.cache = cache
        self.slots = new_token_slots
        self.asked: list[tuple[str, int, tuple[int, ...]]] = []
        for layer in range(cache.config.num_layers):
            self._rows(layer)[self.slots] = UNWRITTEN

    def k_cache(self, layer: int) -> torch.Tensor:
        self.asked.append(("k", layer, self._appended()))
        return self.cache.k_cache(layer)

    def v_cache(self, layer: int) -> torch.Tensor:
        self.asked.append(("v", layer, self._appended()))
        return self.cache.v_cache(layer)

    def times_cache(self) -> torch.Tensor:
        self.asked.append(("times", 0, self._appended()))
        return self.cache.times_cache()

    @property
    def sink_slot(self) -> int:
        return self.cache.sink_slot

    def _rows(self, layer: int) -> torch.Tensor:
        cfg = self.cache.config
        return self.cache.k_cache(layer).view(-1, cfg.num_heads, cfg.head_dim)

    def _appended(self) -> tuple[int, ...]:
        layers = range(self.cache.config.num_layers)
        return tuple(layer for layer in layers if not (self._rows(layer)[self.slots] == UNWRITTEN).any())


def _host(tier: str, device: str, tmp_path, request) -> object:
    pinned = device == "cuda"  # the memory tier's layers then go up as asynchronous DMAs
    if tier == "memory":
        return InMemoryHostStorage(1 << 24, pin_memory=pinned)
    if tier == "disk":
        return DiskHostStorage(tmp_path, 1 << 24)
    if tier == "memory+disk":  # reads from disk are promoted into the memory tier before the onload
        return TieredHostStorage([InMemoryHostStorage(1 << 24, pin_memory=pinned), DiskHostStorage(tmp_path, 1 << 24)])
    return RedisHostStorage(request.getfixturevalue("redis_server"), unique_namespace("layers"), 1 << 24)


@pytest.mark.parametrize("tier", ["memory", "disk", "memory+disk", "redis"])
def test_each_layer_asks_for_its_pages_right_before_it_and_onloads_from_every_tier_keep_parity(
    tier, device, tmp_path, request
):
    cfg = tiny_config()
    model = sensitive_model(cfg, 0).to(device)
    rng = np.random.default_rng(1)
    histories = random_histories(rng, 4, 60, cfg)
    host = _host(tier, device, tmp_path, request)
    cache = KVCacheManager(kv_cache_config(cfg, num_pages=256, device=device), host_storage=host)
    users = list(histories)
    serve(model, cache, histories, [Visit(u, 20 + 3 * u, random_candidates(rng, 2)) for u in users])
    cache.offload_kv_cache()
    cache.evict_kv_cache()  # the next visits onload every user from the tier
    if tier == "memory+disk":
        for u in users:
            host.tiers[0].drop(u)  # read from disk, promoted into the memory tier, onloaded from there
    logs = []

    def logged_forward(batch, kv):
        log = LayerReadinessLog(cache, kv.metadata.new_token_slots)
        logs.append(log)
        return model(batch, PagedKV(log, kv.metadata))

    visits = [Visit(u, 45, random_candidates(rng, 3)) for u in users]
    onloaded_before = cache.stats().onloaded_bytes
    cached = serve(model, cache, histories, visits, forward=logged_forward)
    assert cache.stats().onloaded_bytes > onloaded_before and cache.stats().hits == len(users)
    assert_logits_close(cached, serve(model, None, histories, visits))
    layers = [(which, layer, tuple(range(layer))) for layer in range(cfg.num_layers) for which in ("k", "v")]
    assert [log.asked for log in logs] == [[("times", 0, ()), *layers]]  # the times first, once
    cache.close()
    host.close()
