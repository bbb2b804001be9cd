"""Jagged bookkeeping: the one place that turns per-row lengths into offsets and index ranges
(and finds ids in a sorted id array, which the per-id indexes built on these arrays share).

Host side (numpy): everything here is planned per batch before the device sees it.
"""
from __future__ import annotations

import numpy as np


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


def concat_rows(first_lengths: np.ndarray, second_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the values of two jagged arrays go when each row of the first is followed by the same row
    of the second: lengths [2, 1] and [1, 2] -> first [0, 1, 3], second [2, 4, 5] (slots of the result)."""
    first_lengths = np.asarray(first_lengths, dtype=np.int64)
    row_starts = offsets(first_lengths + np.asarray(second_lengths, dtype=np.int64))[:-1]
    first = range_indices(row_starts, first_lengths)
    second = range_indices(row_starts + first_lengths, second_lengths)
    return first, second


def sorted_lookup(sorted_ids: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> (row of each id in ascending `sorted_ids` (clipped to a valid row), whether it is there)."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(sorted_ids) == 0:
        return np.zeros(len(ids), dtype=np.int64), np.zeros(len(ids), dtype=bool)
    row = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return row.astype(np.int64), sorted_ids[row] == ids


def searchsorted_in_runs(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[B] first index i in [lo[b], hi[b]) with values[i] >= targets[b] (hi[b] if none): a binary
    search inside each run of `values` (ascending within a run), all runs at once."""
    lo, hi = np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64)
    last = max(len(values) - 1, 0)
    while np.any(lo < hi):
        active = lo < hi
        mid = (lo + hi) // 2
        before = active & (values[np.minimum(mid, last)] < targets)
        lo = np.where(before, mid + 1, lo)
        hi = np.where(active & ~before, mid, hi)
    return lo
