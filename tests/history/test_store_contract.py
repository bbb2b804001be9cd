"""The HistoryStore contract (history/base.py), run against every store: SQLite in a temp dir and Redis
on the session's durable redis-server (a namespace per test). Redis cases skip without redis-server."""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from data import schema
from data.event_rules import EVENT_KEY_COLUMNS
from data.manifest import Counts, FeatureVocab, Manifest, PreprocessParams
from helpers import T0, unique_namespace
from history import AppendResult, BatchConflictError, EventBatch, HistoryStore, HistoryUnavailableError
from history.redis_store import RedisHistoryStore
from history.sqlite_store import SQLiteHistoryStore

FAR = T0 + 10**9  # after every event of these tests
COUNT_BITS = [1 << schema.TASKS.index(t) for t in schema.COUNTED_TASKS]


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path) -> Iterator[HistoryStore]:
    """A fresh, empty store of each kind."""
    if request.param == "sqlite":
        opened: HistoryStore = SQLiteHistoryStore(tmp_path / "history.sqlite")
    else:
        url = request.getfixturevalue("durable_redis_server")
        opened = RedisHistoryStore.from_url(url, namespace=unique_namespace("history"))
    yield opened
    opened.close()


def events(*rows: tuple[int, int, int] | dict[str, int]) -> EventBatch:
    """(user, video, seconds after T0) tuples or full records."""
    records = [r if isinstance(r, dict) else {"user_id": r[0], "video_id": r[1], "time_ms": T0 + 1000 * r[2]}
               for r in rows]
    return EventBatch.from_records(records)


def history(store: HistoryStore, user: int, until_ms: int = FAR) -> list[tuple[int, int]]:
    """(video, seconds after T0) of the user's events before until_ms, in history order."""
    got = store.read(np.array([user]), np.array([until_ms]))
    return [(v, (t - T0) // 1000) for v, t in zip(got.video_ids.tolist(), got.timestamps_ms.tolist())]


def manifest(feature_values: tuple[tuple[str, ...], ...]) -> Manifest:
    counts = Counts({}, {}, {}, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    features = tuple(FeatureVocab(f"f{i}", values) for i, values in enumerate(feature_values))
    return Manifest(schema.SCHEMA_VERSION, PreprocessParams(), schema.TASKS, counts, 100, features, {"log.csv": 1})


# ---------------------------------------------------------------- order, identity
def test_events_read_back_in_time_order_ties_in_arrival_order(store):
    store.append(events((1, 10, 5), (1, 11, 3), (1, 12, 5)))
    store.append(events((1, 13, 5), (1, 14, 4), (2, 15, 1)))
    assert history(store, 1) == [(11, 3), (14, 4), (10, 5), (12, 5), (13, 5)]
    assert history(store, 2) == [(15, 1)]


def test_exact_copies_are_stored_once_within_and_across_batches(store):
    assert store.append(events((1, 10, 5), (1, 10, 5), (1, 11, 6))) == AppendResult(2, 1, 0)
    assert store.append(events((1, 11, 6), (1, 12, 7))) == AppendResult(1, 1, 0)
    assert history(store, 1) == [(10, 5), (11, 6), (12, 7)]
    assert store.num_events() == 3


@pytest.mark.parametrize("column", ["play_time_ms", "duration_ms", "tab", "is_rand", "is_click", "long_view"])
def test_an_event_differing_in_one_key_column_is_another_event(store, column):
    first = {"user_id": 1, "video_id": 10, "time_ms": T0, column: 0}
    assert store.append(events(first, {**first, column: 1})) == AppendResult(2, 0, 0)
    assert store.append(events({**first, column: 1})) == AppendResult(0, 1, 0)
    assert history(store, 1) == [(10, 0), (10, 0)]


# ---------------------------------------------------------------- batch ids
def test_a_replayed_batch_id_answers_the_first_result(store):
    batch = events((1, 10, 5), (1, 10, 5), (2, 11, 6))
    first = store.append(batch, batch_id="b-1")
    assert first == AppendResult(2, 1, 0)
    assert store.append(batch, batch_id="b-1") == AppendResult(2, 1, 0, replayed=True)
    assert store.num_events() == 2


def test_a_batch_id_reused_for_other_events_is_refused_and_stores_nothing(store):
    store.append(events((1, 10, 5)), batch_id="b-1")
    with pytest.raises(BatchConflictError):
        store.append(events((1, 10, 5), (3, 12, 1)), batch_id="b-1")
    assert store.stored_user_ids().tolist() == [1]
    assert store.num_events() == 1
    assert store.append(events(), batch_id="empty") == AppendResult(0, 0, 0)
    with pytest.raises(BatchConflictError):
        store.append(events((3, 12, 1)), batch_id="empty")


# ---------------------------------------------------------------- late events, reads
def test_late_counts_stored_events_older_than_the_users_latest_before_the_call(store):
    assert store.append(events((1, 10, 5), (1, 11, 2))).late == 0  # out of order within a call is not late
    # user 1's latest is 5: the event at 3 is late, its copy at 3 a duplicate, at 5 and 6 not late;
    # user 2 had nothing, so nothing of theirs is late.
    result = store.append(events((1, 12, 3), (1, 12, 3), (1, 13, 5), (1, 14, 6), (2, 15, 1), (2, 16, 0)))
    assert result == AppendResult(5, 1, 1)
    assert store.append(events((1, 12, 3))) == AppendResult(0, 1, 0)  # a duplicate is never late


def test_reads_hold_events_strictly_before_until(store):
    store.append(events((1, 10, 1), (1, 11, 2), (1, 12, 3), (2, 13, 2)))
    got = store.read(np.array([1, 2, 3]), np.array([T0 + 2000, T0 + 2001, FAR]))
    assert got.user_ids.tolist() == [1, 2, 3]
    assert got.offsets.tolist() == [0, 1, 2, 2]
    assert got.video_ids.tolist() == [10, 13]
    assert history(store, 1, T0 + 1000) == []


def test_unknown_users_read_empty_with_zero_features(store):
    assert store.read(np.array([5]), np.array([FAR])).user_features.shape == (1, 0)  # no manifest: no features
    store.put_manifest(manifest((("a", "b"), ("x",), ("p", "q", "r"))))
    store.set_user_features(np.array([1, 2]), np.array([[1, 0, 3], [2, 1, 1]]))
    store.append(events((1, 10, 1), (4, 11, 1)))
    got = store.read(np.array([1, 2, 4, 9]), np.array([FAR] * 4))
    assert got.offsets.tolist() == [0, 1, 1, 2, 2]
    assert got.user_features.tolist() == [[1, 0, 3], [2, 1, 1], [0, 0, 0], [0, 0, 0]]
    empty = store.read(np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert empty.offsets.tolist() == [0] and empty.user_features.shape == (0, 3)


def test_manifest_round_trip(store):
    assert store.get_manifest() is None
    first, second = manifest((("a", "b"),)), manifest((("c",), (1, 2)))
    store.put_manifest(first)
    assert store.get_manifest() == first
    store.put_manifest(second)
    assert store.get_manifest() == second


def test_user_ids_and_num_events(store):
    assert store.stored_user_ids().tolist() == [] and store.num_events() == 0
    store.append(events((30, 1, 1), (2, 1, 1), (2**62, 1, 1), (2, 1, 1)))
    assert store.stored_user_ids().tolist() == [2, 30, 2**62]
    assert store.num_events() == 3


def test_snapshot_is_the_read_with_the_stores_counters(store):
    store.append(events((2, 10, 1), (1, 10, 2), (1, 11, 3)))
    snapshot = store.snapshot(np.array([2, 1]), np.array([FAR, T0 + 3000]))
    assert snapshot.user_ids.tolist() == [1, 2] and snapshot.num_events == 2
    assert snapshot.where == store.description
    with pytest.raises(ValueError):
        store.snapshot(np.array([1, 1]), np.array([FAR, FAR]))


# ---------------------------------------------------------------- all or nothing
def poison(store: HistoryStore, video_id: int) -> None:
    """Make storing an event of `video_id` fail inside the store's write, after earlier events of
    the same append were written."""
    if isinstance(store, SQLiteHistoryStore):
        with sqlite3.connect(store.path) as conn:
            conn.execute(f"CREATE TRIGGER poison BEFORE INSERT ON events WHEN NEW.video_id = {video_id} "
                         "BEGIN SELECT RAISE(ABORT, 'poisoned'); END")
    else:
        assert isinstance(store, RedisHistoryStore)
        redis.Redis.from_url(store.description).set(f"{store.namespace}:v:shown:{video_id}", "not a zset")


def test_an_append_failing_midway_stores_nothing(store):
    store.append(events((1, 10, 1)))
    poison(store, 666)
    batch = events((1, 11, 2), (1, 10, 0), (2, 12, 1), (3, 666, 1), (4, 13, 1))
    with pytest.raises(HistoryUnavailableError):
        store.append(batch, batch_id="b")
    assert store.stored_user_ids().tolist() == [1] and store.num_events() == 1
    assert history(store, 1) == [(10, 1)] and history(store, 2) == []
    assert store.counts(np.array([10, 11, 12]), np.array([FAR] * 3)).tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
    # Nothing of it was recorded, not even its batch_id: the same batch without the poisoned event goes in.
    assert store.append(batch.take(np.array([0, 1, 2, 4])), batch_id="b") == AppendResult(4, 0, 1)


# ---------------------------------------------------------------- against brute force
def random_batches(seed: int) -> list[EventBatch]:
    """Events with many ties in time, near-copies (one column apart) and exact copies, in random batches."""
    rng = np.random.default_rng(seed)
    n = 400
    columns = {
        "user_id": rng.integers(0, 8, n), "video_id": rng.integers(0, 12, n),
        "time_ms": T0 + 1000 * rng.integers(0, 60, n), "play_time_ms": rng.integers(0, 2, n),
        **{c: rng.random(n) < 0.3 for c in schema.ACTION_COLUMNS},
    }  # fmt: skip
    key = EventBatch.from_columns({k: np.asarray(v, dtype=np.int64) for k, v in columns.items()}).key_columns
    copies = rng.integers(0, n, n // 4)
    key = np.insert(key, rng.integers(0, n, len(copies)), key[copies], axis=0)
    cuts = np.sort(rng.choice(np.arange(1, len(key)), 12, replace=False))
    return [EventBatch(part) for part in np.split(key, cuts)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_events_match_a_brute_force_model(store, seed):
    user, time, video, weights = (EVENT_KEY_COLUMNS.index(c) for c in ("user_id", "time_ms", "video_id", "action_weights"))
    stored: list[tuple[int, ...]] = []  # in arrival order
    totals = np.zeros(2, np.int64)  # duplicates, late: the data must exercise both
    for batch in random_batches(seed):
        latest = {}
        for row in stored:
            latest[row[user]] = max(latest.get(row[user], row[time]), row[time])
        before = len(stored)
        for row in map(tuple, batch.key_columns.tolist()):
            if row not in stored:
                stored.append(row)
        new = stored[before:]
        late = sum(row[time] < latest.get(row[user], row[time]) for row in new)
        assert store.append(batch) == AppendResult(len(new), len(batch) - len(new), late)
        totals += (len(batch) - len(new), late)
    assert (totals > 0).all()

    rng = np.random.default_rng(seed + 100)
    users = np.arange(10)  # 8 and 9 have no events
    until = T0 + 1000 * rng.integers(0, 61, len(users))
    got = store.read(users, until)
    for i, u in enumerate(users.tolist()):
        rows = [r for r in stored if r[user] == u and r[time] < until[i]]
        rows.sort(key=lambda r: r[time])  # stable: ties keep arrival order
        lo, hi = got.offsets[i], got.offsets[i + 1]
        assert got.video_ids[lo:hi].tolist() == [r[video] for r in rows]
        assert got.timestamps_ms[lo:hi].tolist() == [r[time] for r in rows]
        assert got.action_weights[lo:hi].tolist() == [r[weights] for r in rows]

    videos, times = rng.integers(0, 14, 200), T0 + 1000 * rng.integers(0, 62, 200)
    table = np.array(stored, dtype=np.int64)
    expected = []
    for v, t in zip(videos, times):
        hit = table[(table[:, video] == v) & (table[:, time] < t)]
        expected.append([len(hit), *(int(((hit[:, weights] & bit) > 0).sum()) for bit in COUNT_BITS)])
    assert store.counts(videos, times).tolist() == expected
    assert store.counts(np.zeros(0, np.int64), np.zeros(0, np.int64)).shape == (0, 3)
    assert store.num_events() == len(stored)
    assert store.stored_user_ids().tolist() == sorted({r[user] for r in stored})
