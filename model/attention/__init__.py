"""HSTU attention over a batch of users, in one launch (GPU) or a fixed number of ops (CPU).

`plan_attention` (host, numpy) says where every query and key is; `BatchAttention` carries that
plan and its arrays on the device; `attend` runs the kernel for it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from model.attention import triton_attention
from model.attention.blocked import blocked_hstu_attention
from model.attention.plan import AttentionPlan, BlockSchedule, KeyAddressing, plan_attention
from model.attention.relative_bias import BiasInputs, RelativeAttentionBias
from model.attention.triton_attention import triton_hstu_attention

_SCHEDULE_FIELDS = (
    "block_rows", "block_key_end", "block_query_positions", "pair_blocks", "key_rows", "key_positions", "row_source",
)
_SCHEDULES = {"all": "all_rows", "candidates": "candidate_rows"}


def host_inputs(plan: AttentionPlan) -> dict[str, np.ndarray]:
    """The plan's arrays every attention call of the batch reads on the device."""
    if plan.backend == "triton":
        return {f"attention.triton.{name}": a for name, a in plan.triton_arrays.items()}
    out = {}
    for prefix, attr in _SCHEDULES.items():
        schedule: BlockSchedule = getattr(plan, attr)
        for name in _SCHEDULE_FIELDS:
            out[f"attention.{prefix}.{name}"] = getattr(schedule, name)
    return out


@dataclass(frozen=True)
class BatchAttention:
    plan: AttentionPlan
    arrays: dict[str, Tensor]  # the plan's host_inputs on the device, without their "attention." prefix

    @classmethod
    def from_device(cls, plan: AttentionPlan, device_inputs: Mapping[str, Tensor]) -> BatchAttention:
        prefix = "attention."
        return cls(plan, {name[len(prefix):]: t for name, t in device_inputs.items() if name.startswith(prefix)})


def attend(
    q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, attention: BatchAttention,
    candidates_only: bool, alpha: float, normalizer: float,
    bias: RelativeAttentionBias | None = None, bias_inputs: BiasInputs | None = None,
) -> Tensor:
    """[T, H, D] attention outputs (history rows are left zero when `candidates_only`); with `bias`, the
    layer's relative bias over the positions in the plan and the times in `bias_inputs`."""
    plan, which = attention.plan, "candidates" if candidates_only else "all"
    if bias is not None and bias_inputs is None:
        raise ValueError("a relative bias needs the batch's BiasInputs")
    if plan.backend == "triton":
        arrays = {name: attention.arrays[f"triton.{name}"] for name in _TRITON_USER_ARRAYS}
        arrays["tile_users"] = attention.arrays[f"triton.{which}.tile_users"]
        arrays["tile_rows"] = attention.arrays[f"triton.{which}.tile_rows"]
        return triton_hstu_attention(
            q, k, v, keys, values, arrays, plan.num_history_rows, plan.addressing.page_size, plan.splits,
            alpha, normalizer, bias=bias, bias_inputs=bias_inputs,
        )
    schedule: BlockSchedule = getattr(plan, _SCHEDULES[which])
    arrays = {name: attention.arrays[f"{which}.{name}"] for name in _SCHEDULE_FIELDS}
    return blocked_hstu_attention(
        q, k, v, keys, values, arrays, schedule.num_blocks, schedule.num_pairs, plan.num_history_rows, alpha, normalizer,
        bias=bias, bias_inputs=bias_inputs, schedule_name=which,
    )


_TRITON_USER_ARRAYS = ("history_offsets", "candidate_offsets", "cached_lengths", "page_indptr", "page_indices")

__all__ = [
    "AttentionPlan", "BatchAttention", "BiasInputs", "KeyAddressing", "RelativeAttentionBias", "attend", "host_inputs",
    "plan_attention", "triton_attention",
]
