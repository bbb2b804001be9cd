"""Visits and requests: the de-overlapping contract the KV cache relies on.

A user's events (sorted, numbered 0..n-1) are split into visits: a new visit starts when
the gap to the previous event exceeds the session gap. Visit k >= 1 is one request:

- `time_ms` = time of the visit's first event;
- new chunk `[start, end)` = every event since the previous request: `end` is the
  visit's first event, `start` is the previous request's `end` (0 for the first request);
- candidates = events `[end, end + num_candidates)`, `num_candidates` = min(option,
  events in the visit).

Visit 0 has no history, so it yields no request. Hence a user's chunks are contiguous,
the first starts at 0, each starts where the previous ended, and none is empty.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa

from data import schema


@dataclass(frozen=True)
class RequestTable:
    """One row per request, in (time_ms, user_id) order; request_id = row index. All [R] int64."""

    request_id: np.ndarray
    user_id: np.ndarray
    time_ms: np.ndarray
    start: np.ndarray
    end: np.ndarray
    num_candidates: np.ndarray

    def __len__(self) -> int:
        return len(self.request_id)

    def to_arrow(self) -> pa.Table:
        return pa.table({f.name: pa.array(getattr(self, f.name), pa.int64()) for f in fields(self)})

    @classmethod
    def from_arrow(cls, table: pa.Table) -> RequestTable:
        columns = {name: table.column(name).to_numpy() for name in schema.REQUEST_COLUMNS}
        return cls(**{name: values.astype(np.int64, copy=False) for name, values in columns.items()})


@dataclass(frozen=True)
class VisitSplit:
    requests: RequestTable
    num_visits: int
    num_users_with_requests: int


def split_requests(user_id: np.ndarray, time_ms: np.ndarray, gap_ms: int, num_candidates: int) -> VisitSplit:
    """[E] events sorted by (user_id, time_ms) -> requests sorted by (time_ms, user_id)."""
    n = len(user_id)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return VisitSplit(RequestTable(*(empty,) * len(schema.REQUEST_COLUMNS)), 0, 0)
    new_user = np.ones(n, dtype=bool)
    new_user[1:] = user_id[1:] != user_id[:-1]
    new_visit = new_user.copy()
    new_visit[1:] |= np.diff(time_ms) > gap_ms
    user_first_event = np.flatnonzero(new_user)  # [U] global index of each user's event 0
    user_index = np.cumsum(new_user) - 1  # [E] which user an event belongs to
    visit_first_event = np.flatnonzero(new_visit)  # [V]
    visit_length = np.diff(visit_first_event, append=n)  # [V]

    is_request = ~new_user[visit_first_event]  # every visit but a user's first
    first = visit_first_event[is_request]  # [R] global index of the visit's first event
    users = user_id[first]
    end = first - user_first_event[user_index[first]]  # event number within the user
    first_of_user = np.ones(len(first), dtype=bool)
    first_of_user[1:] = users[1:] != users[:-1]
    start = np.zeros_like(end)
    start[1:] = end[:-1]
    start[first_of_user] = 0
    candidates = np.minimum(num_candidates, visit_length[is_request])
    times = time_ms[first]

    order = np.lexsort((users, times))  # replay order; (time, user) is unique per request
    table = RequestTable(
        request_id=np.arange(len(order), dtype=np.int64),
        user_id=users[order].astype(np.int64),
        time_ms=times[order].astype(np.int64),
        start=start[order].astype(np.int64),
        end=end[order].astype(np.int64),
        num_candidates=candidates[order].astype(np.int64),
    )
    return VisitSplit(table, num_visits=len(visit_first_event), num_users_with_requests=int(first_of_user.sum()))
