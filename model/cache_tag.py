"""The tag stored with a user's cached K/V: a digest of everything those K/V depend on.

K/V of a window are a function of the model's weights, the window start and, for every
cached token, its event (video, action bits, timestamp, the timestamp before it) or its
contextual feature. The tag covers exactly those, so cached K/V are reused only when they
were computed from the same inputs by the same model: a history rewritten upstream, K/V
written by another node for a different history, or a changed model all fail the
comparison and are recomputed instead of silently serving wrong scores.

Tags are computed for a whole batch with a handful of numpy ops. Each event gets a 128-bit
digest of (video, action, timestamp, its index in the user's history) once per dataset; a
window's tag is a digest of (model fingerprint, window start, prefix, the timestamp before
the window, its length, the user's features) plus the wrapping sum of its events' digests,
read from prefix sums in O(1) per user. The index inside the digest makes the sum
order-sensitive; the timestamp before each event is the previous event's own timestamp (or
the window's header), so it is covered too. This is an integrity check against stale data,
not a defence against crafted collisions.
"""
from __future__ import annotations

import hashlib
import weakref

import numpy as np

from data.user_histories import EventArrays, UserHistories

_LANES = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03))  # two independent 64-bit digests
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _fmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective avalanche on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def _digest(seed: np.uint64, *fields: np.ndarray) -> np.ndarray:
    h = np.full(np.broadcast_shapes(*(np.shape(f) for f in fields)), seed, dtype=np.uint64)
    for f in fields:
        h = _fmix(h ^ np.asarray(f).astype(np.uint64))
    return h


class _EventDigestSums:
    """Per lane, prefix sums of the event digests over the flat event arrays: [E + 1] uint64."""

    def __init__(self, events: EventArrays) -> None:
        index_in_user = np.arange(len(events.video_ids), dtype=np.int64) - np.repeat(
            events.offsets[:-1], np.diff(events.offsets)
        )
        self.sums = []
        with np.errstate(over="ignore"):
            for seed in _LANES:
                d = _digest(seed, events.video_ids, events.action_weights, events.timestamps_ms, index_in_user)
                self.sums.append(np.concatenate([np.zeros(1, np.uint64), np.cumsum(d, dtype=np.uint64)]))


_SUMS: weakref.WeakKeyDictionary[UserHistories, _EventDigestSums] = weakref.WeakKeyDictionary()


def window_tags(
    model_fingerprint: str, num_prefix: int, dataset: UserHistories,
    user_ids: np.ndarray, window_starts: np.ndarray, ends: np.ndarray,
) -> list[bytes]:
    """Tags of windows whose cached tokens are the prefix (if num_prefix) and events [w, end)."""
    if dataset not in _SUMS:
        _SUMS[dataset] = _EventDigestSums(dataset.event_arrays())
    sums = _SUMS[dataset].sums
    events = dataset.event_arrays()
    rows = dataset.user_rows(user_ids)
    base = events.offsets[rows]
    w, e = np.asarray(window_starts, np.int64), np.asarray(ends, np.int64)
    prev_ts = events.timestamps_ms[base + np.maximum(w - 1, 0)]
    fp = np.frombuffer(hashlib.blake2b(model_fingerprint.encode(), digest_size=8).digest(), dtype=np.uint64)[0]
    header = [w, np.full_like(w, num_prefix), prev_ts, e - w]
    if num_prefix:
        header += list(events.user_features[rows].T)
    out = []
    with np.errstate(over="ignore"):
        for seed, prefix_sum in zip(_LANES, sums):
            head = _digest(seed ^ fp, *header)
            out.append(head + (prefix_sum[base + e] - prefix_sum[base + w]))
    tags = np.stack(out, axis=1)  # [B, 2] uint64
    return [row.tobytes() for row in tags]
