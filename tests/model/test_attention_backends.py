"""The attention backend contract (model/attention/base.py) and its registry: the model runs any
registered backend without knowing how it tiles, and a bucketed Triton plan has the bucket's shapes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import Visit, assert_logits_close, random_candidates, random_histories, sensitive_model, serve, tiny_config
from model.attention import (
    AttentionBatch,
    BlockedAttention,
    KeyAddressing,
    TritonAttention,
    registry,
    triton_attention,
)
from model.batch_shape import BatchShape

needs_triton = pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")


def test_the_registry_picks_by_name_and_device():
    cfg = tiny_config()
    cpu = torch.device("cpu")
    assert isinstance(registry.resolve("auto", cfg, cpu), BlockedAttention)
    assert isinstance(registry.resolve("blocked", cfg, cpu), BlockedAttention)
    mine = BlockedAttention(64, 64)
    assert registry.resolve(mine, cfg, cpu) is mine
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*blocked, triton"):
        registry.resolve("flash", cfg, cpu)
    with pytest.raises(ValueError, match="per-device choice"):
        registry.register("auto", lambda config, device: mine)
    expected = "triton" if triton_attention.available() else "blocked"
    assert registry.default_backend_name(torch.device("cuda")) == expected


class CountingAttention(BlockedAttention):
    """A third backend, defined outside the package: the blocked one, counting its calls."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.plans = self.attends = 0

    def plan(self, batch):
        self.plans += 1
        return super().plan(batch)

    def attend(self, *args, **kwargs):
        self.attends += 1
        return super().attend(*args, **kwargs)


def test_a_registered_backend_serves_the_model_unchanged(monkeypatch):
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    counting = CountingAttention()
    registry.register("counting", lambda config, device: counting)
    cfg = tiny_config()
    model = sensitive_model(cfg, 2)
    rng = np.random.default_rng(2)
    histories = random_histories(rng, 3, (20, 40), cfg)
    visits = [Visit(u, 15, random_candidates(rng, 3)) for u in histories]
    reference = serve(model, None, histories, visits)
    model.attention_backend = "counting"
    assert_logits_close(serve(model, None, histories, visits), reference)
    assert counting.plans == 1 and counting.attends == cfg.num_layers  # one plan per batch, one call per layer


@needs_triton
def test_triton_refuses_per_candidate_key_ends():
    batch = AttentionBatch.of([3], [2], [0], KeyAddressing(0), candidate_key_ends=[1, 2])
    with pytest.raises(ValueError, match="'triton' does not"):
        TritonAttention(2, 64).plan(batch)
    assert BlockedAttention().plan(batch).batch.candidate_key_ends.tolist() == [1, 2]


@needs_triton
def test_a_bucketed_triton_plan_has_the_buckets_shapes_whatever_the_batch():
    """What a CUDA graph replays: two different batches of one bucket give arrays of the same lengths and
    the same split count, so the capture of the first replays the second."""
    backend = TritonAttention(num_heads=4, max_seq_len=256, num_sms=132)
    shape = BatchShape.bucket(4, 100, 40)
    plans = []
    for cached, new, cands in (([10, 200, 0], [5, 30, 60], [10, 10, 20]), ([0, 0, 0, 250], [1, 2, 3, 4], [1, 1, 1, 1])):
        pages = [-(-(c + n) // 32) for c, n in zip(cached, new)]
        addressing = KeyAddressing(32, np.concatenate([[0], np.cumsum(pages)]), np.arange(sum(pages)))
        plans.append(backend.plan(AttentionBatch.of(new, cands, cached, addressing, shape, bucketed=True)))
    first, second = plans
    assert backend.captures_in_graphs and not BlockedAttention.captures_in_graphs
    assert {k: a.shape for k, a in first.arrays.items()} == {k: a.shape for k, a in second.arrays.items()}
    assert first.splits == second.splits
    assert (first.arrays["all.tile_users"] == -1).any()  # padding tiles exit at once
