"""The history store contract: events are the source of truth, everything served is derived from them.

A store holds every user's logged events and answers the three questions serving asks:

    result = store.append(events, batch_id="client-batch-17")   # durable when it returns; idempotent
    snapshot = store.snapshot(user_ids, until_ms)                # UserHistories: events strictly before
    counts = store.counts(video_ids, times_ms)                   # [M, 3] per-video counters as of a time

Appends follow data/event_rules.py: an event identical to a stored one (in every column of
EVENT_KEY_COLUMNS) is a duplicate and stores nothing; a user's events read back in time order,
ties in arrival order. A `batch_id` makes a whole retried batch idempotent: the same id with the same
events answers the first result again, with other events it is a `BatchConflictError` and nothing is
written. An append is all or nothing. A store that cannot be reached raises `HistoryUnavailableError`
(and has written nothing); an append whose call was sent but not answered (a timeout, a connection
lost mid-call) raises `AppendOutcomeUnknownError`: it may have been applied, whole. Retrying it with
the same batch_id tells which (`replayed`), and stores it at most once either way.

Implementations: history/sqlite_store.py (embedded, one machine) and history/redis_store.py (shared
by every node). history/registry.py opens either from a URL.
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from data.manifest import Manifest
from data.user_histories import EventArrays, UserHistories
from history.events import EventBatch


class HistoryUnavailableError(RuntimeError):
    """The store cannot be reached or refused the call; nothing of the failed call was written (but see
    the subclass `AppendOutcomeUnknownError`)."""


class AppendOutcomeUnknownError(HistoryUnavailableError):
    """An append was sent and no answer came back: it may have been applied (whole) or not. A subclass,
    so that a caller who only retries treats it as unavailable; one who reports the outcome must not
    say "nothing stored"."""


class BatchConflictError(ValueError):
    """A batch_id that was already used for different events (a client bug, not a retry)."""


@dataclass(frozen=True)
class AppendResult:
    appended: int  # events stored by this call
    duplicates: int  # events already stored (or repeated inside the batch): stored nothing
    late: int  # stored events older than their user's latest event before the call: they land inside
    #            the history, so K/V cached past that point are stale (the cache tag catches it)
    replayed: bool = False  # this batch_id was applied before: the result is the first call's


def batch_digest(events: EventBatch) -> bytes:
    """What a batch_id stands for: its events, in order."""
    return hashlib.blake2b(np.ascontiguousarray(events.key_columns).tobytes(), digest_size=16).digest()


class HistoryStore(ABC):
    """Every user's events. Thread-safe: appends and reads may come from any thread."""

    # Calls into the backing database made by `read` and `counts` (a statement, or a pipeline to a
    # server): what serving a visit costs the store; implementations count their own.
    read_round_trips: int = 0

    # ------------------------------------------------------------ the contract
    @abstractmethod
    def append(self, events: EventBatch, batch_id: str | None = None) -> AppendResult:
        """Store `events` (already checked: EventBatch.from_*); durable when it returns."""

    @abstractmethod
    def read(self, user_ids: np.ndarray, until_ms: np.ndarray) -> EventArrays:
        """Events of `user_ids` (sorted, distinct) strictly before `until_ms[i]`, per user in history
        order; a user without events (or without a stored row) has none, features all 0."""

    @abstractmethod
    def counts(self, video_ids: np.ndarray, times_ms: np.ndarray) -> np.ndarray:
        """[M, 3] int64 (shown, clicks, long views) of video i over every user's events before times_ms[i]."""

    @abstractmethod
    def set_user_features(self, user_ids: np.ndarray, features: np.ndarray) -> None:
        """[U] users' [U, F] encoded contextual features (from the bootstrap); replaces earlier ones."""

    @abstractmethod
    def stored_user_ids(self) -> np.ndarray:
        """[U] ascending: every user with a stored event."""

    @abstractmethod
    def num_events(self) -> int:
        """Events stored whole (under a retention rule, not those folded into counters)."""

    @property
    def retention(self):
        """The store's retention rule (history/retention.py), None when it keeps every event."""
        return None

    def set_retention(self, retention) -> int:
        """Keep each user's last events and the counters the model reads of the rest (history/retention.py)."""
        raise NotImplementedError(f"{self.description}: this store keeps every event (retention: the SQLite store)")

    @abstractmethod
    def get_manifest(self) -> Manifest | None:
        """The manifest of the data the store was bootstrapped from (feature vocabularies), if any."""

    @abstractmethod
    def put_manifest(self, manifest: Manifest) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @property
    @abstractmethod
    def description(self) -> str:
        """Where the store lives, for messages ("sqlite:///path", "redis://host:port/db")."""

    # ------------------------------------------------------------ derived
    def snapshot(self, user_ids: np.ndarray, until_ms: np.ndarray) -> UserHistories:
        """The users' histories before their times, as the model reads them (`UserHistories`), with
        this store's video counters."""
        users = np.asarray(user_ids, dtype=np.int64).reshape(-1)
        until = np.asarray(until_ms, dtype=np.int64).reshape(-1)
        order = np.argsort(users, kind="stable")
        if len(users) > 1 and (np.diff(users[order]) == 0).any():
            raise ValueError("a snapshot holds each user at most once")
        return UserHistories(self.read(users[order], until[order]), self.description, video_counts=self)

    def __enter__(self) -> HistoryStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
