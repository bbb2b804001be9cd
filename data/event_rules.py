"""The rules that make a user's history out of logged events, in one place: the preprocessor
(data/preprocess.py) applies them to a whole log at once, the history stores (history/) to
events arriving online, so both produce the same history from the same events.

- **Identity.** Two events are the same event when they agree on every column of
  `EVENT_KEY_COLUMNS`; a later copy is dropped (the first is kept). An online store keys its
  rows by exactly these columns, so a retried append stores nothing twice.
- **Order.** A user's events are ordered by time; events with equal times keep the order in
  which they arrived (file order in a log: the early file first, then row order).
- **Visit boundaries.** A visit at request time t sees the events strictly before t
  (`history_ends`); offline, a visit starts after a gap longer than the session gap
  (data/requests.py), at its first event's time.
"""
from __future__ import annotations

import numpy as np

# Columns that, with user_id, time_ms and video_id, make a row "exactly equal" to another
# (the eight 0/1 action flags enter through action_weights, which encodes them losslessly).
DEDUP_COLUMNS = (
    "date", "hourmin", "play_time_ms", "duration_ms", "profile_stay_time",
    "comment_stay_time", "is_rand", "tab", "action_weights",
)  # fmt: skip
EVENT_KEY_COLUMNS = ("user_id", "time_ms", "video_id", *DEDUP_COLUMNS)


def history_ends(timestamps_ms: np.ndarray, request_time_ms: int) -> int:
    """Events of one user (time-ordered) that a visit at `request_time_ms` sees: those strictly before it."""
    return int(np.searchsorted(timestamps_ms, request_time_ms, side="left"))


def stable_order(user_id: np.ndarray, time_ms: np.ndarray) -> np.ndarray:
    """Permutation sorting rows by (user_id, time_ms); equal keys keep their input order."""
    if len(user_id) == 0:
        return np.zeros(0, dtype=np.int64)
    u0, t0 = int(user_id.min()), int(time_ms.min())
    user_bits = (int(user_id.max()) - u0).bit_length()
    time_bits = (int(time_ms.max()) - t0).bit_length()
    if user_bits + time_bits <= 63:  # one packed int64 key: a single stable sort pass
        key = ((user_id - u0) << time_bits) | (time_ms - t0)
        return np.argsort(key, kind="stable")
    return np.lexsort((time_ms, user_id))


def duplicate_mask(
    user_id: np.ndarray, time_ms: np.ndarray, video_id: np.ndarray, order: np.ndarray, rest: list[np.ndarray]
) -> np.ndarray:
    """[N] rows sorted by (user, time) with ties in file order -> True for every exact copy
    of an earlier row. `order` maps a sorted position to its input row; `rest` holds the
    remaining columns in input row order (only candidate rows are gathered from it).

    Exact: candidates are neighbours after a sort on (user, time, video), each confirmed
    on all remaining columns; a group where that test is not conclusive (A, B, A' with
    one video but B different) is resolved by a full lexicographic sort."""
    n = len(user_id)
    dup = np.zeros(n, dtype=bool)
    same_key = (user_id[1:] == user_id[:-1]) & (time_ms[1:] == time_ms[:-1])
    group = np.concatenate(([0], np.cumsum(~same_key)))  # [N] (user, time) group id
    in_multi = np.zeros(n, dtype=bool)  # only rows sharing (user, time) can be copies
    in_multi[1:] |= same_key
    in_multi[:-1] |= same_key
    multi = np.flatnonzero(in_multi)
    if len(multi) == 0:
        return dup
    g, v = group[multi], video_id[multi]
    v0 = int(v.min())
    group_bits, video_bits = int(g[-1]).bit_length(), (int(v.max()) - v0).bit_length()
    if group_bits + video_bits <= 63:  # (group, video) packed into one key
        key = (g << video_bits) | (v - v0)
        by_key = np.argsort(key, kind="stable")
        key = key[by_key]
        same_gv = key[1:] == key[:-1]
    else:
        by_key = np.lexsort((v, g))
        g, v = g[by_key], v[by_key]
        same_gv = (g[1:] == g[:-1]) & (v[1:] == v[:-1])
    rows = multi[by_key]
    earlier, later = rows[:-1][same_gv], rows[1:][same_gv]
    equal = np.ones(len(later), dtype=bool)
    for column in rest:
        equal &= column[order[later]] == column[order[earlier]]
    dup[later[equal]] = True
    unclear = np.unique(group[later[~equal]])
    if len(unclear):
        rows = multi[np.isin(group[multi], unclear)]
        dup[rows] = False
        values = [*(column[order[rows]] for column in rest), video_id[rows]]
        by_row = np.lexsort([rows, *values, group[rows]])  # lexsort: the last key is primary
        rows, values = rows[by_row], [v[by_row] for v in values]
        equal = group[rows[1:]] == group[rows[:-1]]
        for v in values:
            equal &= v[1:] == v[:-1]
        dup[rows[1:][equal]] = True
    return dup
