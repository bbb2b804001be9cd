"""Jagged bookkeeping: the one place that turns per-row lengths into offsets and index ranges.

Host side (numpy) for everything planned per batch before the device sees it; the device
side uses fbgemm's `asynchronous_complete_cumsum` (CPU and CUDA kernels, no host sync).
"""
from __future__ import annotations

import numpy as np
import torch


def offsets(lengths: np.ndarray) -> np.ndarray:
    """[B] lengths -> [B + 1] int64 offsets: offsets[0] = 0, offsets[-1] = lengths.sum()."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def row_ids_and_ranks(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's row and its index within the row: lengths [2, 0, 3] -> rows [0, 0, 2, 2, 2],
    ranks [0, 1, 0, 1, 2]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    return rows, np.arange(len(rows), dtype=np.int64) - offsets(lengths)[rows]


def range_indices(begin: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation over i of arange(begin[i], begin[i] + lengths[i]): [sum(lengths)] int64."""
    rows, ranks = row_ids_and_ranks(lengths)
    return np.asarray(begin, dtype=np.int64)[rows] + ranks


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Device side: [B] lengths -> [B + 1] offsets (fbgemm; no host sync on CUDA)."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    return torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.to(torch.int64))
