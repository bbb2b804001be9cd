"""Child process of test_sqlite_kill.py: append batches to a SQLite history store until killed.

    ingest_until_killed.py STORE SEED

Prints "ready" once imported, then, after each `append` of batch i returns, the line "i" (flushed):
that line is the acknowledgement a client would get, so every printed index must survive a
`kill -9`. Batch i of a seed is `make_batch(seed, i)`, so the test rebuilds what was sent.

Kept light on purpose (one interpreter start per kill): numpy and the store only, never torch.
"""
from __future__ import annotations

import sys

import numpy as np

from history.events import EventBatch
from history.sqlite_store import SQLiteHistoryStore

USERS = 12
T0 = 1_650_000_000_000  # 2022-04-15
SPAN_MS = 30 * 86_400_000
MAX_EVENTS = 120  # per batch; video ids leave room for 1000


def batch_id(seed: int, index: int) -> str:
    return f"{seed}-{index}"


def make_batch(seed: int, index: int) -> EventBatch:
    """Batch `index` of `seed`: 1..MAX_EVENTS events of random users at random times (most land inside
    their user's stored history: late events), a few exact copies inside the batch. Apart from the
    copies every event is distinct from every other batch's: its video id encodes (seed, index, row)."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(1, MAX_EVENTS + 1))
    columns = {
        "user_id": rng.integers(0, USERS, n),
        "video_id": (seed * 1_000_000 + index) * 1_000 + np.arange(n),
        "time_ms": T0 + rng.integers(0, SPAN_MS // 1000, n) * 1000,  # whole seconds: ties happen
        "is_click": rng.integers(0, 2, n),
        "long_view": rng.integers(0, 2, n),
        "play_time_ms": rng.integers(0, 20_000, n),
    }
    copies = rng.random(n) < 0.1
    copies[0] = False  # row 0 has nothing earlier to copy
    for row in np.flatnonzero(copies):
        earlier = int(rng.integers(0, row))  # in row order: a copy of a copy is a copy too
        for values in columns.values():
            values[row] = values[earlier]
    return EventBatch.from_columns(columns)


def main(path: str, seed: int) -> None:
    if "torch" in sys.modules:
        sys.exit("the ingestion child imported torch: the history store must not need it")
    store = SQLiteHistoryStore(path)
    print("ready", flush=True)
    for index in range(1_000_000):
        store.append(make_batch(seed, index), batch_id=batch_id(seed, index))
        print(index, flush=True)  # the acknowledgement: only once append has returned


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
