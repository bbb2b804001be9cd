"""HSTU attention over a batch of users, in one launch (GPU) or a fixed number of ops (CPU).

`plan_attention` (host, numpy) says where every query and key is; `BatchAttention` carries that
plan and its arrays on the device; `attend` runs the kernel for it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from model.attention.blocked import blocked_hstu_attention
from model.attention.plan import AttentionPlan, BlockSchedule, KeyAddressing, plan_attention

_SCHEDULE_FIELDS = ("block_rows", "block_key_end", "pair_blocks", "key_rows", "key_positions", "row_source")
_SCHEDULES = {"all": "all_rows", "candidates": "candidate_rows"}


def host_inputs(plan: AttentionPlan) -> dict[str, np.ndarray]:
    """The plan's arrays every attention call of the batch reads on the device."""
    out = {}
    for prefix, attr in _SCHEDULES.items():
        schedule: BlockSchedule = getattr(plan, attr)
        for name in _SCHEDULE_FIELDS:
            out[f"attention.{prefix}.{name}"] = getattr(schedule, name)
    return out


@dataclass(frozen=True)
class BatchAttention:
    plan: AttentionPlan
    schedules: dict[str, dict[str, Tensor]]  # "all" / "candidates" -> schedule arrays on the device

    @classmethod
    def from_device(cls, plan: AttentionPlan, device_inputs: Mapping[str, Tensor]) -> BatchAttention:
        schedules = {
            prefix: {name: device_inputs[f"attention.{prefix}.{name}"] for name in _SCHEDULE_FIELDS}
            for prefix in _SCHEDULES
        }
        return cls(plan, schedules)


def attend(
    q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, attention: BatchAttention,
    candidates_only: bool, alpha: float, normalizer: float,
) -> Tensor:
    """[T, H, D] attention outputs (history rows are left zero when `candidates_only`)."""
    prefix = "candidates" if candidates_only else "all"
    schedule: BlockSchedule = getattr(attention.plan, _SCHEDULES[prefix])
    return blocked_hstu_attention(
        q, k, v, keys, values, attention.schedules[prefix], schedule.num_blocks, schedule.num_pairs,
        attention.plan.num_history_rows, alpha, normalizer,
    )


__all__ = ["AttentionPlan", "BatchAttention", "KeyAddressing", "attend", "host_inputs", "plan_attention"]
