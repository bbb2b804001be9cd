"""The Triton backend: one kernel launch per layer for the whole batch (model/attention/triton_attention.py).

Its plan is query tiles of BLOCK_M rows (`tile_users`, `tile_rows`) and int32 per-user extents
and page tables; the kernel walks each tile's keys itself. Everything it launches is sized by the
plan's shape, and a bucketed plan's arrays have lengths fixed by the bucket (tiles and page table
at their capacity, the split count from the bucket alone), so a CUDA graph replays one capture for
every batch of a bucket: padding users have no rows and padding tiles belong to user -1.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from model.attention import triton_attention
from model.attention.base import AttentionBackend, AttentionBatch, AttentionPlan
from model.attention.relative_bias import BiasInputs, RelativeAttentionBias
from model.attention.triton_attention import split_count, tile_capacity, tile_schedule, triton_hstu_attention

_USER_ARRAYS = ("history_offsets", "candidate_offsets", "cached_lengths", "page_indptr", "page_indices")


@dataclass(frozen=True)
class TritonPlan(AttentionPlan):
    arrays: dict[str, np.ndarray]  # int32: _USER_ARRAYS, and {all, candidates}.{tile_users, tile_rows}
    splits: int  # programs splitting each tile's key range


class TritonAttention(AttentionBackend):
    """`max_seq_len` bounds a bucketed batch's windows (its page table and split count); `num_sms` sizes
    the key split (None: no split, as off CUDA); `splits` fixes it instead."""

    name = "triton"
    supports_candidate_key_ends = False
    captures_in_graphs = True

    def __init__(self, num_heads: int, max_seq_len: int, num_sms: int | None = None, splits: int | None = None):
        if not triton_attention.available():
            raise RuntimeError("the triton attention backend needs triton (pip install triton)")
        self.num_heads, self.max_seq_len, self.num_sms, self.fixed_splits = num_heads, max_seq_len, num_sms, splits

    @classmethod
    def for_device(cls, num_heads: int, max_seq_len: int, device: torch.device) -> TritonAttention:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        return cls(num_heads, max_seq_len, num_sms)

    def __repr__(self) -> str:
        return f"TritonAttention(num_heads={self.num_heads}, max_seq_len={self.max_seq_len}, num_sms={self.num_sms})"

    def splits_for(self, num_tiles: int, max_keys: int) -> int:
        """Key splits that keep ~TARGET_PROGRAMS_PER_SM programs per SM."""
        if self.fixed_splits is not None:
            return self.fixed_splits
        if self.num_sms is None:
            return 1
        return split_count(num_tiles, self.num_heads, max_keys, self.num_sms)

    def plan(self, batch: AttentionBatch) -> TritonPlan:
        self.check(batch)
        n, m, c, shape = batch.history_lengths, batch.candidate_lengths, batch.cached_lengths, batch.shape
        pad_users = shape.users - batch.num_users

        def padded(user_offsets: np.ndarray) -> np.ndarray:  # [B + 1] -> [users + 1]: padding users are empty
            return np.pad(user_offsets, (0, pad_users), mode="edge").astype(np.int32)

        addressing = batch.addressing
        if addressing.paged:
            indptr, indices = addressing.page_indptr, addressing.page_indices
        else:
            indptr, indices = np.zeros(batch.num_users + 1, np.int64), np.zeros(0, np.int64)
        # A bucket's arrays have fixed lengths: its page table holds any window, its split depends on the bucket only.
        if batch.bucketed and addressing.paged:
            capacity = shape.users * -(-self.max_seq_len // addressing.page_size)
        else:
            capacity = max(1, len(indices))
        if len(indices) > capacity:
            raise ValueError(f"{len(indices)} pages do not fit the plan's page capacity of {capacity}")
        longest = self.max_seq_len if batch.bucketed else int((c + n).max(initial=1))
        tiles = tile_capacity(shape.num_rows, shape.users)
        arrays = {
            "history_offsets": padded(batch.history_offsets),
            "candidate_offsets": padded(batch.candidate_offsets),
            "cached_lengths": np.pad(c, (0, pad_users)).astype(np.int32),
            "page_indptr": padded(indptr),
            "page_indices": np.pad(indices, (0, capacity - len(indices))).astype(np.int32),
        }
        for name, first_row in (("all", np.zeros_like(n)), ("candidates", n)):
            users, rows = tile_schedule(n + m, first_row, None if batch.is_exact else tiles)
            arrays[f"{name}.tile_users"], arrays[f"{name}.tile_rows"] = users, rows
        return TritonPlan(batch, self, arrays, self.splits_for(tiles, longest))

    def host_inputs(self, plan: TritonPlan) -> dict[str, np.ndarray]:
        return dict(plan.arrays)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, plan: TritonPlan,
        arrays: Mapping[str, Tensor], candidates_only: bool, alpha: float, normalizer: float,
        bias: RelativeAttentionBias | None, bias_inputs: BiasInputs | None,
    ) -> Tensor:
        which = "candidates" if candidates_only else "all"
        launch = {name: arrays[name] for name in _USER_ARRAYS}
        launch["tile_users"], launch["tile_rows"] = arrays[f"{which}.tile_users"], arrays[f"{which}.tile_rows"]
        return triton_hstu_attention(
            q, k, v, keys, values, launch, plan.num_history_rows, plan.batch.addressing.page_size, plan.splits,
            alpha, normalizer, bias=bias, bias_inputs=bias_inputs, key_window=plan.batch.key_window,
        )
