"""kill -9 during ingestion loses no acknowledged event of the embedded store (history/sqlite_store.py).

A child process (ingest_until_killed.py) appends batches with batch ids and acknowledges each on
stdout once `append` has returned; the test SIGKILLs it at a random moment, reopens the store and
checks: it opens cleanly (integrity_check), every acknowledged batch is recorded and all its events
are there, at most the one batch in flight is recorded beyond those, and the stored events are
exactly those of the recorded batches (none partly). Then it retries the batch in flight, as a
client that got no answer would: a replay if it was committed, stored now otherwise. One store
through every kill, so each run also recovers the previous run's interrupted WAL.
"""
from __future__ import annotations

import importlib.util
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

import numpy as np

from helpers import REPO_ROOT, subprocess_env
from history.sqlite_store import SQLiteHistoryStore

CHILD = Path(__file__).with_name("ingest_until_killed.py")
KILLS = 20
MAX_DELAY_S = 0.3  # after the first acknowledgement


def _load_child():
    spec = importlib.util.spec_from_file_location("ingest_until_killed", CHILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load_child()


def run_and_kill(path: Path, seed: int, delay_s: float) -> list[int]:
    """Start the child on `path`, SIGKILL it `delay_s` after its first acknowledgement; -> acked indices."""
    proc = subprocess.Popen([sys.executable, str(CHILD), str(path), str(seed)], cwd=REPO_ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for expected in ("ready", "0"):
            line = proc.stdout.readline()
            assert line == f"{expected}\n", f"child said {line!r} instead of {expected!r}: {proc.stderr.read()}"
        time.sleep(delay_s)
        proc.kill()  # SIGKILL
        proc.wait(timeout=30)
        # Read through the text buffer: readline may already hold later acknowledgements, which
        # communicate() (reading the raw pipe) would skip.
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -9
    lines = rest.split("\n")
    acked = [0, *(int(x) for x in lines[:-1])]  # a last line without its newline is no acknowledgement
    assert acked == list(range(len(acked))), "acknowledgements come in batch order"
    return acked


def stored_events(store: SQLiteHistoryStore) -> Counter:
    """Every stored event as (user, video, time, action_weights), with multiplicity."""
    users = store.stored_user_ids()
    events = store.read(users, np.full(len(users), 2**62, dtype=np.int64))
    user = np.repeat(events.user_ids, np.diff(events.offsets))
    return Counter(zip(user.tolist(), events.video_ids.tolist(), events.timestamps_ms.tolist(),
                       events.action_weights.tolist()))


def batch_events(seed: int, index: int) -> set[tuple[int, int, int, int]]:
    """The distinct events of a batch, as `stored_events` counts them (video ids tell batches apart)."""
    batch = child.make_batch(seed, index)
    return set(zip(batch.user_id.tolist(), batch.video_id.tolist(), batch.time_ms.tolist(),
                   batch.action_weights.tolist()))


def recorded_batches(path: Path) -> set[str]:
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        return {row[0] for row in conn.execute("SELECT batch_id FROM batches")}


def test_kill_9_loses_no_acknowledged_event(tmp_path: Path):
    rng = np.random.default_rng(20240611)
    path = tmp_path / "history.sqlite"
    committed: set[str] = set()  # batch ids of earlier runs (all recorded: their batch in flight was retried)
    expected: set[tuple[int, int, int, int]] = set()  # the events of those batches
    for seed in range(1, KILLS + 1):
        acked = run_and_kill(path, seed, float(rng.uniform(0, MAX_DELAY_S)))
        in_flight = acked[-1] + 1  # sent, maybe committed, never acknowledged

        recorded = recorded_batches(path)
        this_run = recorded - committed
        assert committed <= recorded, "a batch recorded before the run is gone"
        assert {child.batch_id(seed, i) for i in acked} <= this_run, "an acknowledged batch was lost"
        assert this_run <= {child.batch_id(seed, i) for i in [*acked, in_flight]}, "a batch never sent is recorded"
        committed_in_flight = child.batch_id(seed, in_flight) in this_run
        for i in acked + ([in_flight] if committed_in_flight else []):
            expected |= batch_events(seed, i)

        with SQLiteHistoryStore(path) as store:
            stored = stored_events(store)
            assert set(stored) == expected, (f"run {seed}: {len(expected - set(stored))} events of recorded batches "
                                             f"missing, {len(set(stored) - expected)} of unrecorded ones stored")
            assert max(stored.values()) == 1 and store.num_events() == len(expected)
            # The client of the batch in flight got no answer and retries it.
            retry = store.append(child.make_batch(seed, in_flight), batch_id=child.batch_id(seed, in_flight))
            assert retry.replayed == committed_in_flight
            expected |= batch_events(seed, in_flight)
            assert store.num_events() == len(expected)
        committed |= this_run | {child.batch_id(seed, in_flight)}
        assert recorded_batches(path) == committed
