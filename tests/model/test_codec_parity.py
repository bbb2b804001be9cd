"""Codecs end to end: returning users onloaded from tiers that store encoded pages.

The lossless codec gives logits bit-identical to raw tiers; a lossy codec stays within the logit
error this project claims for it (docs/kvcache.md, "Compressed tiers"), on a model whose logits
react to small K/V changes (`sensitive_model`)."""
from __future__ import annotations

import pytest
import torch

from data.dataset import InferenceDataset
from helpers import build_processed, sensitive_model
from kvcache import KVCacheConfig, KVCacheManager
from model.config import config_for_dataset
from model.inference import InferenceSession

# Claimed bounds of max |logit diff| against raw tiers (the replay measures them on trained models).
LOGIT_TOLERANCE = {"bf16": 1e-3, "int8": 5e-3, "int8:mode=affine": 5e-3, "mixed": 5e-3}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("codecs")
    dataset = InferenceDataset(build_processed(root))
    model = sensitive_model(config_for_dataset("tiny", dataset), 0)
    return dataset, model, returning_logits(model, dataset)


def returning_logits(model, dataset, tmp_path=None, count=60, **tiers):
    """Logits of the second half of a replay, served after every user was evicted from the device:
    each returning user is onloaded from the host tiers."""
    cfg = model.config
    cache = KVCacheManager(KVCacheConfig(
        num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim, page_size=cfg.page_size,
        num_pages=300, host_capacity_bytes=1 << 22, **tiers,
    ))
    session = InferenceSession(model, dataset, kv_cache=cache)
    indices = dataset.request_indices(max_requests=count)
    with cache:
        for batch in dataset.batches(indices[: count // 2], 4):
            session.serve(batch)
        cache.offload_kv_cache()
        cache.evict_kv_cache()
        results = [session.serve(b) for b in dataset.batches(indices[count // 2:], 4)]
        assert cache.stats().onloaded_bytes > 0
    assert sum(r.tokens_reused for r in results) > 0
    return torch.cat([r.logits.flatten() for r in results])


@pytest.mark.parametrize("codec", ["zstd", "zstd-channel"])
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_lossless_codec_logits_equal_raw_bit_for_bit(world, tmp_path, tier, codec):
    dataset, model, raw = world
    extra = {"persistent_dir": str(tmp_path / "kv")} if tier == "disk" else {}
    lossless = returning_logits(model, dataset, kv_codec=codec, **extra)
    assert torch.equal(raw, lossless)


@pytest.mark.parametrize("codec", ["bf16", "int8", "mixed"])
def test_lossy_codec_logits_within_claimed_bound(world, codec):
    dataset, model, raw = world
    lossy = returning_logits(model, dataset, kv_codec=codec)
    diff = float((raw - lossy).abs().max())
    print(f"{codec}: max |logit diff| {diff:.3g}")
    assert 0 < diff <= LOGIT_TOLERANCE[codec]


def test_sparse_keeping_every_token_is_exact_and_dropping_tokens_moves_logits(world):
    """A sparse codec that keeps 100% is raw by another name: bit-identical logits. Dropping tokens moves
    them, more the fewer it keeps; folding the dropped ones into a merged token (merge=1) moves them less."""
    dataset, model, raw = world
    assert torch.equal(raw, returning_logits(model, dataset, kv_codec="sparse:keep=100,recent=0"))

    def error(spec: str) -> float:
        return float((raw - returning_logits(model, dataset, kv_codec=spec)).abs().mean())

    half, fifth = error("sparse:keep=50,merge=0,recent=0"), error("sparse:keep=20,merge=0,recent=0")
    assert 0 < half < fifth
    assert 0 < error("sparse:keep=20,merge=1,recent=1") < fifth
