"""Attention backends by name: the one place that knows which backends exist and which serves a device.

    backend = resolve("auto", config, device)      # the Triton kernel on CUDA, the torch path elsewhere
    backend = resolve("blocked", config, device)   # by name
    backend = resolve(BlockedAttention(128, 128), config, device)   # an instance is used as it is
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from model.attention import triton_attention
from model.attention.base import AttentionBackend
from model.attention.blocked_backend import BlockedAttention
from model.attention.triton_backend import TritonAttention

if TYPE_CHECKING:  # model.config imports this package (the bias limits)
    from model.config import HSTUConfig

Factory = Callable[["HSTUConfig", torch.device], AttentionBackend]
AUTO = "auto"

_FACTORIES: dict[str, Factory] = {
    "blocked": lambda config, device: BlockedAttention(),
    "triton": lambda config, device: TritonAttention.for_device(config.num_heads, config.max_seq_len, device),
}


def register(name: str, factory: Factory) -> None:
    """Make a backend selectable by name (`HSTURecommender.attention_backend = name`)."""
    if name == AUTO:
        raise ValueError(f"{AUTO!r} names the per-device choice, not a backend")
    _FACTORIES[name] = factory


def default_backend_name(device: torch.device) -> str:
    """The Triton kernel on CUDA (when triton imports); the blocked torch path elsewhere."""
    return "triton" if device.type == "cuda" and triton_attention.available() else "blocked"


def resolve(spec: str | AttentionBackend, config: HSTUConfig, device: torch.device) -> AttentionBackend:
    """The backend `spec` names for a model of `config` on `device` ("auto": `default_backend_name`)."""
    if isinstance(spec, AttentionBackend):
        return spec
    name = default_backend_name(device) if spec == AUTO else spec
    if name not in _FACTORIES:
        raise ValueError(f"unknown attention backend {spec!r}; choose {AUTO} or one of {', '.join(_FACTORIES)}")
    return _FACTORIES[name](config, device)
