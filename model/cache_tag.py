"""The tag stored with a user's cached K/V: a digest of everything those K/V depend on.

K/V of a window are a function of the model's weights, the window start and, for every
cached token, its event (video, action bits, timestamp, the timestamp before it) or its
contextual feature. The tag hashes exactly those, so cached K/V are reused only when
they were computed from the same inputs by the same model: a history rewritten upstream,
KV written by another node for a different history, or a changed model all fail the
comparison and are recomputed instead of silently serving wrong scores.
"""
from __future__ import annotations

import hashlib

import numpy as np

from data.dataset import UserEvents

TAG_BYTES = 32


def window_tag(model_fingerprint: str, window_start: int, num_prefix: int, events: UserEvents) -> bytes:
    """Tag of a window whose cached tokens are the prefix (if num_prefix) and `events`."""
    digest = hashlib.blake2b(digest_size=TAG_BYTES)
    digest.update(model_fingerprint.encode())
    digest.update(np.array([window_start, num_prefix, events.prev_timestamp_ms, len(events.video_ids)],
                           dtype=np.int64).tobytes())
    if num_prefix:
        digest.update(np.ascontiguousarray(events.user_features, dtype=np.int64).tobytes())
    for values in (events.video_ids, events.action_weights, events.timestamps_ms):
        digest.update(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    return digest.digest()
