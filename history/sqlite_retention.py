"""Retention in the SQLite store (history/retention.py has the rule): the folded counters' tables and
the statements that fold, check and stand in, each run inside the store's own transaction.

    folded_users   user_id -> events folded, time of the latest
    folded_pairs   (user_id, video_id) -> shown, then each counted action (one column per COUNTED_TASKS)
    folded_videos  video_id -> the same over every user, and the time of the latest
    meta 'retention' -> "keep_events,window_events"
"""
from __future__ import annotations

import sqlite3

import numpy as np

from data.schema import COUNTED_TASKS
from history.events import EventBatch
from history.retention import Retention, RetentionError, fold_counts, stand_ins

_COUNTS = ", ".join(["shown", *(f"n_{t}" for t in COUNTED_TASKS)])
_WIDTH = 1 + len(COUNTED_TASKS)
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS folded_users (user_id INTEGER PRIMARY KEY, events INTEGER NOT NULL, last_time_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS folded_pairs (user_id INTEGER NOT NULL, video_id INTEGER NOT NULL,
    {", ".join(f"{c} INTEGER NOT NULL" for c in _COUNTS.split(", "))}, PRIMARY KEY (user_id, video_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS folded_videos (video_id INTEGER PRIMARY KEY,
    {", ".join(f"{c} INTEGER NOT NULL" for c in _COUNTS.split(", "))}, last_time_ms INTEGER NOT NULL);
"""
_ADD = ", ".join(f"{c} = {c} + excluded.{c}" for c in _COUNTS.split(", "))
_PLACES = ", ".join("?" * _WIDTH)


def load_retention(conn: sqlite3.Connection) -> Retention | None:
    row = conn.execute("SELECT value FROM meta WHERE key = 'retention'").fetchone()
    return None if row is None else Retention(*map(int, row[0].split(",")))


def save_retention(conn: sqlite3.Connection, retention: Retention) -> None:
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('retention', ?)",
                 (f"{retention.keep_events},{retention.window_events}",))


def drop_folded_past(conn: sqlite3.Connection, events: EventBatch) -> tuple[EventBatch, int]:
    """-> (the events after their user's latest folded time, how many were not): a copy of a folded
    event cannot be told from a new one, so those count as already stored."""
    users = np.unique(events.user_id).tolist()
    horizon = dict(conn.execute(f"SELECT user_id, last_time_ms FROM folded_users WHERE user_id IN "
                                f"({', '.join('?' * len(users))})", users).fetchall()) if users else {}
    if not horizon:
        return events, 0
    never = np.iinfo(np.int64).min
    past = events.time_ms <= np.array([horizon.get(u, never) for u in events.user_id.tolist()], np.int64)
    return events.take(~past), int(past.sum())


def fold_users(conn: sqlite3.Connection, user_ids: list[int], keep_events: int) -> int:
    """Fold each user's events beyond its last `keep_events` into the counters and delete them -> events folded."""
    folded = 0
    for user in user_ids:
        excess = conn.execute("SELECT COUNT(*) FROM events WHERE user_id = ?", (user,)).fetchone()[0] - keep_events
        if excess <= 0:
            continue
        rows = np.array(conn.execute(
            "SELECT seq, time_ms, video_id, action_weights FROM events WHERE user_id = ? "
            "ORDER BY time_ms, seq LIMIT ?", (user, excess)).fetchall(), dtype=np.int64)
        last = int(rows[:, 1].max())
        videos, counts = fold_counts(rows[:, 2], rows[:, 3])
        conn.execute("INSERT INTO folded_users VALUES (?, ?, ?) ON CONFLICT (user_id) DO UPDATE SET "
                     "events = events + excluded.events, last_time_ms = MAX(last_time_ms, excluded.last_time_ms)",
                     (user, len(rows), last))
        conn.executemany(f"INSERT INTO folded_pairs VALUES (?, ?, {_PLACES}) ON CONFLICT DO UPDATE SET {_ADD}",
                         [(user, v, *c) for v, c in zip(videos.tolist(), counts.tolist())])
        video_last = {v: int(rows[rows[:, 2] == v, 1].max()) for v in videos.tolist()}
        conn.executemany(f"INSERT INTO folded_videos VALUES (?, {_PLACES}, ?) ON CONFLICT DO UPDATE SET {_ADD}, "
                         "last_time_ms = MAX(last_time_ms, excluded.last_time_ms)",
                         [(v, *c, video_last[v]) for v, c in zip(videos.tolist(), counts.tolist())])
        conn.executemany("DELETE FROM events WHERE seq = ?", [(s,) for s in rows[:, 0].tolist()])
        folded += len(rows)
    return folded


def stand_in_rows(conn: sqlite3.Connection, user: int, until_ms: int, kept_before: int,
                  retention: Retention) -> np.ndarray:
    """[S, 4] (time_ms, seq, video_id, action_weights) standing in for the user's folded events, to go
    before its kept ones; RetentionError when the kept events cannot serve a visit at `until_ms`."""
    row = conn.execute("SELECT events, last_time_ms FROM folded_users WHERE user_id = ?", (user,)).fetchone()
    if row is None:
        return np.zeros((0, 4), np.int64)
    if until_ms <= row[1]:
        raise RetentionError(f"user {user}: a visit at {until_ms} lies in the folded past (events up to {row[1]} "
                             "are kept as counters only)")
    if kept_before < retention.window_events:
        raise RetentionError(f"user {user}: {kept_before} kept events before {until_ms}, the window needs "
                             f"{retention.window_events} (events stored ahead of the visit exceed the slack)")
    pairs = np.array(conn.execute(f"SELECT video_id, {_COUNTS} FROM folded_pairs WHERE user_id = ?",
                                  (user,)).fetchall(), dtype=np.int64).reshape(-1, 1 + _WIDTH)
    video_ids, weights = stand_ins(pairs[:, 0], pairs[:, 1:])
    out = np.empty((len(video_ids), 4), np.int64)
    out[:, 0], out[:, 1], out[:, 2], out[:, 3] = row[1], -1, video_ids, weights
    return out


def add_folded_video_counts(conn: sqlite3.Connection, keys: np.ndarray, out: np.ndarray) -> None:
    """Add the folded counts to `out` [K, 1 + K'] of (video, time) `keys` [K, 2]; RetentionError for a
    time at or before the video's latest folded event."""
    videos = np.unique(keys[:, 0]).tolist()
    folded = {}
    for lo in range(0, len(videos), 900):
        chunk = videos[lo:lo + 900]
        for video, *rest in conn.execute(f"SELECT video_id, {_COUNTS}, last_time_ms FROM folded_videos "
                                         f"WHERE video_id IN ({', '.join('?' * len(chunk))})", chunk):
            folded[video] = rest
    for i, (video, time) in enumerate(keys.tolist()):
        if video in folded:
            *counts, last = folded[video]
            if time <= last:
                raise RetentionError(f"video {video}: counters at {time} lie in the folded past (up to {last})")
            out[i] += counts
