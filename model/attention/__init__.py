"""HSTU attention over a batch of users, in one launch (GPU) or a fixed number of ops (CPU).

The contract is model/attention/base.py: a backend plans a batch on the host, names the arrays its
plan reads on the device, and attends. `registry.resolve` picks a backend by name and device.
"""
from __future__ import annotations

from model.attention import registry, triton_attention
from model.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionPlan,
    BatchAttention,
    KernelVariant,
    KeyAddressing,
    KeyWindow,
    attend,
    host_inputs,
    recording_variants,
)
from model.attention.blocked_backend import BlockedAttention
from model.attention.relative_bias import BiasInputs, RelativeAttentionBias
from model.attention.triton_backend import TritonAttention

__all__ = [
    "AttentionBackend", "AttentionBatch", "AttentionPlan", "BatchAttention", "BiasInputs", "BlockedAttention",
    "KernelVariant", "KeyAddressing", "KeyWindow", "RelativeAttentionBias", "TritonAttention", "attend", "host_inputs",
    "recording_variants", "registry", "triton_attention",
]
