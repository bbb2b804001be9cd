"""Jagged-tensor bookkeeping: the one place that turns per-row lengths into offsets.

Uses fbgemm's `asynchronous_complete_cumsum` (a registered op with CPU and CUDA kernels),
so the same call works on either device without a host sync.
"""
from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B + 1] offsets, offsets[0] = 0, offsets[-1] = lengths.sum()."""
    return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.to(torch.int64))


def row_ids_and_ranks(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a jagged tensor with `total` values: each value's row and its index within the row.

    lengths [B] -> (row_ids [total], ranks [total]); e.g. lengths [2, 0, 3] ->
    rows [0, 0, 2, 2, 2], ranks [0, 1, 0, 1, 2].
    """
    lengths = lengths.to(torch.int64)
    offsets = offsets_from_lengths(lengths)
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)
    ranks = torch.ops.fbgemm.offsets_range(offsets, total)
    return rows, ranks
