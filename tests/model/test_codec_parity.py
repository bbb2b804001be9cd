"""Codecs end to end: returning users onloaded from tiers that store encoded pages.

The lossless codec gives logits bit-identical to raw tiers; a lossy codec stays within the logit
error this project claims for it (docs/kvcache.md, "Compressed tiers"), on a model whose logits
react to small K/V changes (`sensitive_model`)."""
from __future__ import annotations

import pytest
import torch

from data.dataset import InferenceDataset
from helpers import build_processed, returning_users, sensitive_model
from model.config import config_for_dataset

# Claimed bounds of max |logit diff| against raw tiers (the replay measures them on trained models).
LOGIT_TOLERANCE = {"bf16": 1e-3, "int8": 5e-3, "int8:mode=affine": 5e-3, "mixed": 5e-3}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("codecs")
    dataset = InferenceDataset(build_processed(root))
    model = sensitive_model(config_for_dataset("tiny", dataset), 0)
    return dataset, model, returning_logits(model, dataset)


def returning_logits(model, dataset, **tiers):
    """Logits of returning users, each onloaded from the host tiers (`helpers.returning_users`)."""
    return returning_users(model, dataset, host_capacity_bytes=1 << 22, **tiers)[0]


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
