"""A visit as the library takes it: who, when, which candidates, and what happened since last time.

    visit = Visit(user_id=7, request_time_ms=1650000123000, candidate_video_ids=np.array([17, 5, 99]),
                  new_events=EventBatch.from_records([{"user_id": 7, "video_id": 3, "time_ms": 1650000120000}]))
    result = session.score([visit, ...])          # one visit per user per call

`new_events` (the user's events since their last visit, or their whole history) are appended to the
session's history store before the visit is scored; the visit then sees every stored event of the user
strictly before `request_time_ms`, however and whenever those events arrived.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from history.events import EventBatch

DEVICE, HOST, SHARED, NONE = "device", "host", "shared", "none"  # where a visit's reused K/V came from


@dataclass(frozen=True)
class Visit:
    user_id: int
    request_time_ms: int
    candidate_video_ids: np.ndarray  # [m] int64
    new_events: EventBatch | None = field(default=None)


def check_visits(visits: Sequence[Visit]) -> EventBatch | None:
    """The visits' new events as one batch (None: none), or a ValueError naming the visit and field."""
    if not visits:
        raise ValueError("score() needs at least one visit")
    users = [int(v.user_id) for v in visits]
    if len(set(users)) != len(users):
        raise ValueError("a call scores each user at most once (a later visit depends on the earlier one)")
    batches = []
    for i, visit in enumerate(visits):
        cands = np.asarray(visit.candidate_video_ids)
        if cands.size == 0:
            raise ValueError(f"visits[{i}] (user {visit.user_id}): candidate_video_ids is empty")
        if cands.dtype.kind not in "iu" or int(cands.min()) < 0:
            raise ValueError(f"visits[{i}] (user {visit.user_id}): candidate_video_ids must be non-negative integers")
        events = visit.new_events
        if events is not None and len(events):
            other = events.user_id != visit.user_id
            if other.any():
                raise ValueError(f"visits[{i}] (user {visit.user_id}): new_events[{int(np.flatnonzero(other)[0])}] "
                                 f"belongs to user {int(events.user_id[other][0])}")
            batches.append(events)
    return EventBatch.concat(batches) if batches else None


@dataclass(frozen=True)
class VisitCache:
    """Where a visit's reused K/V came from and what it cost (tokens: cache positions)."""

    tier: str  # DEVICE | HOST (this node's own host tiers) | SHARED (reloaded from a shared tier) | NONE
    tokens_reused: int  # history tokens read from the cache
    tokens_computed: int  # history tokens (prefix included) and candidates run through the model
    tokens_recomputed: int  # of the computed history tokens, those a host tier held (a stale device copy)
    shared_reload_bytes: int  # K/V bytes reloaded from the shared tier


def visit_caches(layout, ends: np.ndarray, residences: Sequence | None, reused: np.ndarray, computed: np.ndarray,
                 page_size: int, page_nbytes: int) -> list[VisitCache]:
    """Each visit's `VisitCache`, from the plan it was served with: `residences` (kvcache `Residence`s
    the plan was made from; None: no cache), `reused` / `computed` tokens per visit [B]."""
    if residences is None:
        return [VisitCache(NONE, 0, int(c), 0, 0) for c in computed.tolist()]
    best = np.array([r.best_host or (0, 0) for r in residences], dtype=np.int64).reshape(-1, 2)
    could = layout.visit_spans(ends, best[:, 0], best[:, 1]).expected_cached_lengths  # [B] from the best host entry
    out = []
    for b, r in enumerate(residences):
        got, recomputed, reload_bytes = int(reused[b]), 0, 0
        if r.on_device:
            tier = DEVICE if got else NONE
            recomputed = max(0, int(could[b]) - got) if r.best_host else 0
        elif not got:
            tier = NONE
        elif r.own_host == (r.version.start_pos, r.version.length):
            tier = HOST
        else:
            tier, reload_bytes = SHARED, -(-r.version.length // page_size) * page_nbytes
        out.append(VisitCache(tier, got, int(computed[b]), recomputed, reload_bytes))
    return out
