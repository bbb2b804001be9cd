"""A token's stamp: the one int64 per token that the relative attention bias reads besides positions.

    stamp = tag_row << STAMP_TIME_BITS | time_ms        (NO_STAMP = -1: a token with neither)

The low 42 bits hold the token's time in ms since 1970 (room until 2109); the bits above them hold
its video's tag row when the model has a tag-match bias, else 0. The page pool keeps one int64
per slot beside the K/V (`KVCacheManager.times_cache()`), moved, offloaded, reloaded and evicted
with its page. Packing the tag into that word makes a cached key's tag travel every path its
time already does, so the tag-match bias between a new query and a cached key is computed from
what the cache holds, with no second per-slot array for every tier and codec to carry.

A stamp without tag bits is the plain time, so checkpoints and caches written before the tag
match read the same. Only one model's stamps ever share a pool: the tag table's digest is part of
the model fingerprint the cache is keyed by.

    >>> stamps = token_stamps(np.array([1_650_000_000_000, -1]), np.array([3, 3]))
    >>> stamps[0] >> STAMP_TIME_BITS, stamps[0] & STAMP_TIME_MASK, stamps[1]
    (np.int64(3), np.int64(1650000000000), np.int64(-1))
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

NO_STAMP = -1  # a token with no time and no tag (a contextual-prefix token, a padding row)
STAMP_TIME_BITS = 42
STAMP_TIME_MASK = (1 << STAMP_TIME_BITS) - 1
MAX_STAMP_TAG = (1 << (63 - STAMP_TIME_BITS)) - 1  # the sign bit stays clear: negative means no stamp


def token_stamps(times_ms: np.ndarray, tag_rows: np.ndarray | None) -> np.ndarray:
    """Host int64 times (NO_STAMP where a token has none) and tag rows (None: no tag) -> stamps."""
    times_ms = np.asarray(times_ms, np.int64)
    if len(times_ms) and times_ms.max(initial=0) > STAMP_TIME_MASK:
        bad = int(np.argmax(times_ms))
        raise ValueError(f"timestamp {int(times_ms[bad])} ms (token {bad}) is past {STAMP_TIME_MASK}, the latest "
                         f"time a token stamp holds (year 2109): are the timestamps in ms?")
    if tag_rows is None:
        return times_ms.copy()
    tag_rows = np.asarray(tag_rows, np.int64)
    if len(tag_rows) and (tag_rows.min() < 0 or tag_rows.max() > MAX_STAMP_TAG):
        raise ValueError(f"tag rows must be in [0, {MAX_STAMP_TAG}] to fit a token stamp, got "
                         f"[{tag_rows.min()}, {tag_rows.max()}]")
    return np.where(times_ms < 0, NO_STAMP, (tag_rows << STAMP_TIME_BITS) | times_ms)


def stamp_times(stamps: Tensor) -> Tensor:
    """The times (ms) in int64 stamps; NO_STAMP stays NO_STAMP, as does any negative stamp."""
    return torch.where(stamps < 0, NO_STAMP, stamps & STAMP_TIME_MASK)


def stamp_tag_match(query_stamps: Tensor, key_stamps: Tensor) -> Tensor:
    """Broadcastable stamps -> bool: the two tokens carry the same known tag (row > 0; row 0 is the
    unknown tag, and a negative stamp none)."""
    query_tags = query_stamps >> STAMP_TIME_BITS  # arithmetic shift: negative stamps give negative tags
    return (query_tags == (key_stamps >> STAMP_TIME_BITS)) & (query_tags > 0)
