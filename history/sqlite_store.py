"""The embedded history store: SQLite in WAL mode, fsynced on every commit; no server to run.

    store = SQLiteHistoryStore("/var/lib/hstu/history.sqlite")

An acknowledged append survives `kill -9` of the process and a power loss: each append is one
transaction, committed with `synchronous=FULL` (the WAL is fsynced before `append` returns).
Processes on the same machine may share the file (SQLite serialises writers); nodes on other
machines need the shared store (history/redis_store.py).

Tables (one B-tree each, besides the rowid table):
    events   seq (arrival order, the rowid) + the EVENT_KEY_COLUMNS, UNIQUE over those: the dedup key,
             which also serves a user's history by (user_id, time_ms)
    events_by_video (video_id, time_ms, action_weights): the video counters, a covering range count
    users    user_id -> encoded features;  batches  batch_id -> digest + result;  meta  key -> value
    folded_* the counters of events a retention rule folded (history/sqlite_retention.py)
"""
from __future__ import annotations

import dataclasses
import sqlite3
import threading
from pathlib import Path

import numpy as np

from data.event_rules import EVENT_KEY_COLUMNS
from data.manifest import Manifest
from data.schema import COUNTED_TASKS, TASKS
from data.user_histories import EventArrays
from history import sqlite_retention as retained
from history.base import AppendResult, BatchConflictError, HistoryStore, HistoryUnavailableError, batch_digest
from history.events import EventBatch
from history.retention import Retention

_KEYS = ", ".join(EVENT_KEY_COLUMNS)
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, {", ".join(f"{c} INTEGER NOT NULL" for c in EVENT_KEY_COLUMNS)},
                                   UNIQUE ({_KEYS}));
CREATE INDEX IF NOT EXISTS events_by_video ON events (video_id, time_ms, action_weights);
CREATE TABLE IF NOT EXISTS users (user_id INTEGER PRIMARY KEY, features BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (batch_id TEXT PRIMARY KEY, digest BLOB NOT NULL,
                                    appended INTEGER, duplicates INTEGER, late INTEGER);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_INSERT = f"INSERT OR IGNORE INTO events ({_KEYS}) VALUES ({', '.join('?' * len(EVENT_KEY_COLUMNS))})"
_COUNT_BITS = [1 << TASKS.index(t) for t in COUNTED_TASKS]
CACHE_KIB = 64 * 1024  # page cache per connection (one per thread)
WAL_CHECKPOINT_PAGES = 20_000
_MAX_QUERY_ROWS = 2000  # rows per VALUES list (3 variables each, under SQLite's 32766)


class SQLiteHistoryStore(HistoryStore):
    def __init__(self, path: str | Path, timeout_s: float = 10.0) -> None:
        """Open (or create) the store at `path`; `timeout_s`: how long a writer waits for another's lock."""
        self.path = Path(path)
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        with self._write_lock:
            self._connection().executescript(_SCHEMA + retained.SCHEMA)

    @property
    def description(self) -> str:
        return f"sqlite://{self.path}"

    def _connection(self) -> sqlite3.Connection:
        """One connection per thread (SQLite's rule); writers take `_write_lock` as well."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                # Live appends touch pages all over the user and video indexes: a cache that keeps them
                # and a WAL checkpointed every ~80 MB rather than every 4 MB (SQLite's default) make an
                # append of 1,000 events ~1.8x cheaper (measured; durability is the same either way).
                conn.execute(f"PRAGMA cache_size={-CACHE_KIB}")
                conn.execute(f"PRAGMA wal_autocheckpoint={WAL_CHECKPOINT_PAGES}")
            except sqlite3.Error as err:
                raise HistoryUnavailableError(f"{self.description}: {err}") from err
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    # ------------------------------------------------------------ writes
    def append(self, events: EventBatch, batch_id: str | None = None) -> AppendResult:
        digest = batch_digest(events) if batch_id is not None else None
        with self._write_lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if batch_id is not None:
                        row = conn.execute("SELECT digest, appended, duplicates, late FROM batches WHERE batch_id = ?",
                                           (batch_id,)).fetchone()
                        if row is not None:
                            conn.execute("ROLLBACK")
                            if row[0] != digest:
                                raise BatchConflictError(f"batch_id {batch_id!r} was used before for other events")
                            return AppendResult(row[1], row[2], row[3], replayed=True)
                    result = self._insert_retained(conn, events)
                    if batch_id is not None:
                        conn.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?)",
                                     (batch_id, digest, result.appended, result.duplicates, result.late))
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as err:
                raise HistoryUnavailableError(f"{self.description}: append failed, nothing stored: {err}") from err
        return result

    def _insert_retained(self, conn: sqlite3.Connection, events: EventBatch) -> AppendResult:
        """`_insert` under the store's retention rule, if it has one: events in a user's folded past
        count as duplicates, and users past `keep_events` are folded."""
        retention = retained.load_retention(conn)
        if retention is None:
            return self._insert(conn, events)
        events, folded_past = retained.drop_folded_past(conn, events)
        result = self._insert(conn, events)
        retained.fold_users(conn, np.unique(events.user_id).tolist(), retention.keep_events)
        return dataclasses.replace(result, duplicates=result.duplicates + folded_past)

    def set_retention(self, retention: Retention) -> int:
        """Keep each user's last `retention.keep_events` events from now on, folding the rest now -> events folded."""
        def fold_all(conn: sqlite3.Connection) -> int:
            retained.save_retention(conn, retention)
            users = [r[0] for r in conn.execute("SELECT DISTINCT user_id FROM events").fetchall()]
            return retained.fold_users(conn, users, retention.keep_events)

        return self._in_write_transaction(fold_all, "setting retention failed, nothing changed")

    @property
    def retention(self) -> Retention | None:
        return retained.load_retention(self._connection())

    def _insert(self, conn: sqlite3.Connection, events: EventBatch) -> AppendResult:
        users = np.unique(events.user_id).tolist()
        latest = {}
        for lo in range(0, len(users), _MAX_QUERY_ROWS):  # MAX per user: one index probe each
            chunk = users[lo:lo + _MAX_QUERY_ROWS]
            latest.update(conn.execute(
                f"WITH q(u) AS (VALUES {', '.join(['(?)'] * len(chunk))}) "
                "SELECT u, (SELECT MAX(time_ms) FROM events WHERE user_id = q.u) FROM q", chunk).fetchall())
        # Events that would land inside their user's stored history are inserted one by one, to
        # count those actually stored; the others (live traffic's usual case) in one executemany.
        never = np.iinfo(np.int64).min
        user_latest = np.array([latest.get(u) or never for u in events.user_id.tolist()], np.int64)
        inside = events.time_ms < user_latest
        before = conn.total_changes
        late = sum(conn.execute(_INSERT, row).rowcount for row in events.key_columns[inside].tolist())
        conn.executemany(_INSERT, events.key_columns[~inside].tolist())
        appended = conn.total_changes - before
        return AppendResult(appended, len(events) - appended, late)

    def set_user_features(self, user_ids: np.ndarray, features: np.ndarray) -> None:
        rows = [(int(u), np.asarray(f, dtype="<i8").tobytes()) for u, f in zip(user_ids, features)]
        self._write("INSERT OR REPLACE INTO users VALUES (?, ?)", rows)

    def put_manifest(self, manifest: Manifest) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES (?, ?)", [("manifest", manifest.to_json())])

    def _write(self, sql: str, rows: list[tuple]) -> None:
        self._in_write_transaction(lambda conn: conn.executemany(sql, rows), "write failed, nothing stored")

    def _in_write_transaction(self, work, failure: str):
        """`work(conn)` in one write transaction: all of it or, on a database error, none."""
        with self._write_lock:
            conn = self._connection()
            try:
                with conn:
                    conn.execute("BEGIN IMMEDIATE")
                    return work(conn)
            except sqlite3.Error as err:
                raise HistoryUnavailableError(f"{self.description}: {failure}: {err}") from err

    # ------------------------------------------------------------ reads
    def read(self, user_ids: np.ndarray, until_ms: np.ndarray) -> EventArrays:
        users = np.asarray(user_ids, dtype=np.int64).reshape(-1)
        conn = self._connection()
        parts, lengths = [], []
        try:
            conn.execute("BEGIN")  # one consistent view of every user of the batch
            retention = retained.load_retention(conn)
            for user, until in zip(users.tolist(), np.asarray(until_ms, dtype=np.int64).tolist()):
                rows = conn.execute(
                    "SELECT time_ms, seq, video_id, action_weights FROM events WHERE user_id = ? AND time_ms < ?",
                    (user, until)).fetchall()
                part = np.array(rows, dtype=np.int64).reshape(-1, 4)
                if retention is not None:  # stand-ins (seq -1) sort before the kept events
                    part = np.concatenate([retained.stand_in_rows(conn, user, until, len(part), retention), part])
                parts.append(part[np.lexsort((part[:, 1], part[:, 0]))])
                lengths.append(len(part))
            features = self._features(conn, users)
            conn.execute("COMMIT")
            self.read_round_trips += len(users) + 4  # BEGIN, one per user, manifest + features, COMMIT
        except BaseException as err:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(err, sqlite3.Error):
                raise HistoryUnavailableError(f"{self.description}: read failed: {err}") from err
            raise
        flat = np.concatenate(parts) if parts else np.zeros((0, 4), np.int64)
        offsets = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return EventArrays(users, offsets, flat[:, 2].copy(), flat[:, 3].copy(), flat[:, 0].copy(), features)

    def _features(self, conn: sqlite3.Connection, users: np.ndarray) -> np.ndarray:
        manifest = self.get_manifest(conn)
        width = len(manifest.user_features) if manifest is not None else 0
        out = np.zeros((len(users), width), dtype=np.int64)
        if width and len(users):
            found = dict(conn.execute(
                f"SELECT user_id, features FROM users WHERE user_id IN ({', '.join('?' * len(users))})",
                users.tolist()).fetchall())
            for i, user in enumerate(users.tolist()):
                if user in found:
                    out[i] = np.frombuffer(found[user], dtype="<i8")
        return out

    def counts(self, video_ids: np.ndarray, times_ms: np.ndarray) -> np.ndarray:
        videos = np.asarray(video_ids, dtype=np.int64).reshape(-1)
        times = np.asarray(times_ms, dtype=np.int64).reshape(-1)
        keys, inverse = np.unique(np.stack([videos, times], axis=1), axis=0, return_inverse=True)
        out = np.zeros((len(keys), 1 + len(_COUNT_BITS)), dtype=np.int64)
        sums = ", ".join(f"TOTAL((e.action_weights & {bit}) > 0)" for bit in _COUNT_BITS)
        conn = self._connection()
        try:
            for lo in range(0, len(keys), _MAX_QUERY_ROWS):
                chunk = keys[lo:lo + _MAX_QUERY_ROWS]
                values = ", ".join("(?, ?, ?)" for _ in range(len(chunk)))
                params = [x for i, (v, t) in enumerate(chunk.tolist()) for x in (lo + i, v, t)]
                rows = conn.execute(
                    f"WITH q(i, v, t) AS (VALUES {values}) SELECT q.i, COUNT(e.video_id), {sums} "
                    "FROM q LEFT JOIN events AS e INDEXED BY events_by_video ON e.video_id = q.v AND e.time_ms < q.t "
                    "GROUP BY q.i", params).fetchall()
                for i, *row in rows:
                    out[i] = row
                self.read_round_trips += 1
            if retained.load_retention(conn) is not None:
                retained.add_folded_video_counts(conn, keys, out)
        except sqlite3.Error as err:
            raise HistoryUnavailableError(f"{self.description}: counters read failed: {err}") from err
        return out[inverse.reshape(-1)]

    def stored_user_ids(self) -> np.ndarray:
        rows = self._connection().execute("SELECT DISTINCT user_id FROM events ORDER BY user_id").fetchall()
        return np.array([r[0] for r in rows], dtype=np.int64)

    def num_events(self) -> int:
        return int(self._connection().execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def get_manifest(self, conn: sqlite3.Connection | None = None) -> Manifest | None:
        row = (conn or self._connection()).execute("SELECT value FROM meta WHERE key = 'manifest'").fetchone()
        return None if row is None else Manifest.from_json(row[0], source=self.description)

    def close(self) -> None:
        with self._connections_lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()
