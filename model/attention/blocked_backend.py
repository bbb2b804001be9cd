"""The blocked torch backend: the CPU path, training (it has a backward) and the reference.

It plans (query block, key block) pairs (model/attention/blocked_schedule.py) and runs them in a
fixed number of torch ops per chunk of pairs (model/attention/blocked.py). Its loops are sized by
the batch's pair count, so it is not captured in CUDA graphs.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from model.attention import blocked_schedule
from model.attention.base import AttentionBackend, AttentionBatch, AttentionPlan
from model.attention.blocked import blocked_hstu_attention
from model.attention.blocked_schedule import BlockSchedule, BlockScheduler, query_block_for
from model.attention.relative_bias import BiasInputs, RelativeAttentionBias

_SCHEDULE_FIELDS = (
    "block_rows", "block_key_end", "block_key_start", "block_query_positions", "pair_blocks", "key_rows",
    "key_positions", "row_source",
)


@dataclass(frozen=True)
class BlockedPlan(AttentionPlan):
    all_rows: BlockSchedule  # every query row
    candidate_rows: BlockSchedule  # candidates only (the last layer)

    def schedule(self, candidates_only: bool) -> tuple[str, BlockSchedule]:
        return ("candidates", self.candidate_rows) if candidates_only else ("all", self.all_rows)


class BlockedAttention(AttentionBackend):
    """`query_block` fixes the query block (default: the cheapest for each schedule, `query_block_for`);
    `key_block` the key block (default: blocked_schedule.KEY_BLOCK). Training takes smaller ones: its
    windows are short and its backward pays for every padded slot of a block."""

    name = "blocked"
    supports_candidate_key_ends = True
    captures_in_graphs = False

    def __init__(self, query_block: int | None = None, key_block: int | None = None) -> None:
        self.query_block, self.key_block = query_block, key_block

    def __repr__(self) -> str:
        return f"BlockedAttention(query_block={self.query_block}, key_block={self.key_block})"

    def plan(self, batch: AttentionBatch) -> BlockedPlan:
        self.check(batch)
        n, m, c = batch.history_lengths, batch.candidate_lengths, batch.cached_lengths
        scheduler = BlockScheduler(batch, self.key_block or blocked_schedule.KEY_BLOCK)
        all_rows = scheduler.blocks(np.zeros_like(n), self.query_block or query_block_for(n + m, c + n))
        candidate_rows = scheduler.blocks(n, self.query_block or query_block_for(m, c + n))
        return BlockedPlan(batch, self, all_rows, candidate_rows)

    def host_inputs(self, plan: BlockedPlan) -> dict[str, np.ndarray]:
        out = {}
        for candidates_only in (False, True):
            which, schedule = plan.schedule(candidates_only)
            for name in _SCHEDULE_FIELDS:
                out[f"{which}.{name}"] = getattr(schedule, name)
        return out

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, plan: BlockedPlan,
        arrays: Mapping[str, Tensor], candidates_only: bool, alpha: float, normalizer: float,
        bias: RelativeAttentionBias | None, bias_inputs: BiasInputs | None,
    ) -> Tensor:
        which, schedule = plan.schedule(candidates_only)
        schedule_arrays = {name: arrays[f"{which}.{name}"] for name in _SCHEDULE_FIELDS}
        return blocked_hstu_attention(
            q, k, v, keys, values, schedule_arrays, schedule.num_blocks, schedule.num_pairs, plan.num_history_rows,
            alpha, normalizer, bias=bias, bias_inputs=bias_inputs, schedule_name=which,
            key_window=plan.batch.key_window,
        )
