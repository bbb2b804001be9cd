"""Checks of what callers pass to `KVCacheManager`: each raises a `KVCacheRequestError` naming
the user and the token range, before the manager changes anything."""
from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .errors import KVCacheRequestError, KVCacheStaleError

UserIds = Sequence[int] | Tensor
# Token positions travel to the device as int32 (page tables, kernels): the last one must fit.
MAX_TOKEN_POSITION = 2**31 - 1
# User ids are int64 wherever they are tensors (batches, page tables, the serving API): [0, 2**63).
MAX_USER_ID = 2**63 - 1


def int_list(values: UserIds, name: str) -> list[int]:
    """The integers of a 1-D integer tensor or a sequence of ints; bools are refused (True is not user 1)."""
    if isinstance(values, Tensor):
        if values.dim() != 1 or values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
            raise KVCacheRequestError(f"{name} must be a 1-D integer tensor, got {values.dtype} {tuple(values.shape)}.")
        return values.tolist()
    if isinstance(values, (str, bytes)):
        raise KVCacheRequestError(f"{name} must be a sequence of ints, got {type(values).__name__}.")
    out = []
    for v in values:
        if isinstance(v, (bool, np.bool_)):
            raise KVCacheRequestError(f"{name} must hold ints, got the bool {v!r}.")
        try:
            out.append(operator.index(v))
        except TypeError as exc:
            raise KVCacheRequestError(f"{name} must be a sequence of ints: {exc}") from exc
    return out


def user_id_list(values: UserIds) -> list[int]:
    """The user ids, each in [0, 2**63)."""
    users = int_list(values, "user_ids")
    for u in users:
        check_user_id(u)
    return users


def check_user_id(u: int) -> int:
    if isinstance(u, (bool, np.bool_)) or not isinstance(u, (int, np.integer)) or not 0 <= u <= MAX_USER_ID:
        raise KVCacheRequestError(f"user id {u!r:.40} is not an integer in [0, 2**63).")
    return int(u)


def not_in_flight(user_ids: UserIds, in_flight: set[int], verb: str) -> list[int]:
    """The users, none of which may have a prepare in flight (they are about to be `verb`)."""
    users = user_id_list(user_ids)
    for u in users:
        if u in in_flight:
            raise KVCacheRequestError(f"User {u} has a prepare in flight and cannot be {verb}; commit or roll it back first.")
    return users


def tag_list(tags: Sequence[bytes], n: int) -> list[bytes]:
    if isinstance(tags, (bytes, bytearray, str)) or len(tags) != n:
        raise KVCacheRequestError(f"tags must be a sequence of {n} bytes values (one per user), got {tags!r:.80}.")
    out = []
    for t in tags:
        if not isinstance(t, (bytes, bytearray, memoryview)):
            raise KVCacheRequestError(f"tags must be bytes values, got {type(t).__name__}.")
        out.append(bytes(t))
    return out


def check_range(u: int, start: int, new: int) -> None:
    if start < 0 or new < 0:
        raise KVCacheRequestError(f"User {u}: start_pos and new_length must be >= 0, got {start} and {new}.")
    if start + new > MAX_TOKEN_POSITION:
        raise KVCacheRequestError(
            f"User {u}: tokens [{start}, {start + new}) reach past the largest token position {MAX_TOKEN_POSITION}."
        )


def check_expected(u: int, start: int, expected_len: int, cached_start: int, cached_len: int) -> None:
    """The caller planned `expected_len` cached tokens right before `start`: the cache must hold exactly that."""
    if expected_len < 0:
        raise KVCacheRequestError(f"User {u}: expected_cached_length must be >= 0, got {expected_len}.")
    holds_expected = cached_len == expected_len and (cached_len == 0 or cached_start + cached_len == start)
    if not holds_expected:
        held = f"{cached_len} tokens from position {cached_start}" if cached_len else "nothing"
        planned = f"{expected_len} tokens before position {start}" if expected_len else "nothing cached"
        raise KVCacheStaleError(
            f"User {u}: the cache holds {held}, but the batch was planned against {planned} "
            "(another caller changed it since); call get_user_kvdata_info again and re-plan."
        )


def check_continues(u: int, start: int, cached_start: int, cached_end: int) -> None:
    if start > cached_end:
        raise KVCacheRequestError(
            f"User {u}: The input sequence has missing tokens from {cached_end} to {start - 1} (both inclusive)."
        )
    if start < cached_start:
        raise KVCacheRequestError(
            f"User {u}: The input sequence starts at {start}, before the cached tokens [{cached_start}, {cached_end}); "
            "invalidate the user's cache to restart it."
        )
    if start < cached_end:
        raise KVCacheRequestError(
            f"User {u}: The input sequence has overlapping tokens from {start} to {cached_end - 1} (both inclusive)."
        )
