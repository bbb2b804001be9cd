"""The event rules shared by the preprocessor and the history stores (data/event_rules.py): the same
rows give the same histories whether they are preprocessed from the logs at once or appended to a
store, an offline base and then live batches, retried and duplicated on the way."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.dataset import InferenceDataset
from data.manifest import PreprocessParams
from data.preprocess import preprocess
from helpers import MINUTE, T0, feature_row, log_row, write_raw_dir
from history.events import EventBatch
from history.sqlite_store import SQLiteHistoryStore

USERS = (1, 2, 3)
UNTIL_ALL = 2**62
# Few distinct times (many ties), some within a visit, some past the 30-minute session gap.
TIME_OFFSETS = tuple(m * MINUTE for m in (0, 1, 2, 45, 46, 200, 2000))

row_strategy = st.builds(
    lambda user, offset, video, click, long_view, play, tab: log_row(
        user, video, T0 + offset, is_click=click, long_view=long_view, play_time_ms=play, tab=tab),
    st.sampled_from(USERS), st.sampled_from(TIME_OFFSETS), st.integers(0, 3), st.integers(0, 1),
    st.integers(0, 1), st.sampled_from([1_000, 2_000]), st.integers(0, 1),
)  # fmt: skip


def draw_rows(data: st.DataObject) -> list[dict[str, int]]:
    """Random rows, then copies inserted anywhere: exact ones, and ones that differ from their
    source only in a column the model does not read (a distinct event to both sides)."""
    rows = data.draw(st.lists(row_strategy, min_size=1, max_size=16), label="rows")
    for _ in range(data.draw(st.integers(0, 8), label="copies")):
        copy = dict(rows[data.draw(st.integers(0, len(rows) - 1), label="source")])
        if data.draw(st.booleans(), label="differs in play_time_ms"):
            copy["play_time_ms"] += 1
        rows.insert(data.draw(st.integers(0, len(rows)), label="at"), copy)
    return rows


def append_like_live(store: SQLiteHistoryStore, rows: list[dict[str, int]], data: st.DataObject) -> int:
    """An offline base (`rows` up to a random point, one append), then the rest in random batches,
    each maybe retried (with its batch id or without one) and maybe followed by copies of rows
    appended before. -> events stored by first appends (retries and copies must store nothing)."""
    base = data.draw(st.integers(0, len(rows)), label="base rows")
    stored = store.append(EventBatch.from_records(rows[:base])).appended if base else 0
    at, number = base, 0
    while at < len(rows):
        end = min(at + data.draw(st.integers(1, 4), label="batch size"), len(rows))
        batch = EventBatch.from_records(rows[at:end])
        batch_id = f"live-{number}" if data.draw(st.booleans(), label="with batch id") else None
        first = store.append(batch, batch_id=batch_id)
        stored += first.appended
        for _ in range(data.draw(st.integers(0, 2), label="retries")):
            same_id = batch_id is not None and data.draw(st.booleans(), label="retry with the batch id")
            again = store.append(batch, batch_id=batch_id if same_id else None)
            if same_id:  # a replay answers the first call's result and stores nothing (checked by the count)
                assert again.replayed and (again.appended, again.duplicates, again.late) == \
                    (first.appended, first.duplicates, first.late)
            else:
                assert not again.replayed and (again.appended, again.duplicates) == (0, len(batch))
        at, number = end, number + 1
        if data.draw(st.booleans(), label="send old rows again"):
            old = data.draw(st.lists(st.integers(0, at - 1), min_size=1, max_size=3), label="old rows")
            again = store.append(EventBatch.from_records([rows[i] for i in old]))
            assert again.appended == 0 and again.duplicates == len(old)
    return stored


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_store_holds_the_preprocessors_histories(data: st.DataObject):
    rows = draw_rows(data)
    early_rows = data.draw(st.integers(0, len(rows)), label="rows in the early log")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = write_raw_dir(root / "raw", rows[:early_rows], rows[early_rows:], [feature_row(u) for u in USERS])
        preprocess(raw, root / "out", PreprocessParams(), progress=False)
        expected = InferenceDataset(root / "out").event_arrays()
        with SQLiteHistoryStore(root / "store.sqlite") as store:
            stored = append_like_live(store, rows, data)  # the same rows in file order: early log, then late
            assert stored == store.num_events() == len(expected.video_ids)
            np.testing.assert_array_equal(store.stored_user_ids(), expected.user_ids)
            got = store.read(expected.user_ids, np.full(len(expected.user_ids), UNTIL_ALL, dtype=np.int64))
    for name in ("offsets", "video_ids", "action_weights", "timestamps_ms"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)


def test_a_late_event_lands_at_its_time_and_is_counted_late(tmp_path: Path):
    def event(user: int, video: int, minute: int) -> dict[str, int]:
        return {"user_id": user, "video_id": video, "time_ms": T0 + minute * MINUTE}

    with SQLiteHistoryStore(tmp_path / "store.sqlite") as store:
        first = store.append(EventBatch.from_records([event(1, 10, 10), event(1, 20, 20), event(1, 30, 30),
                                                      event(2, 99, 50)]))
        assert (first.appended, first.late) == (4, 0)
        # Older than user 1's latest (30): late, inside the history (a tie after the stored event of
        # its time: arrival order). At the latest time itself or after it: not late; user 2's later
        # event does not make user 1's late; a copy of a stored event is a duplicate, not late.
        result = store.append(EventBatch.from_records([event(1, 15, 15), event(1, 21, 20), event(1, 31, 30),
                                                       event(1, 40, 40), event(1, 10, 10), event(2, 98, 49)]))
        assert (result.appended, result.duplicates, result.late) == (5, 1, 3)  # 15, 21 and 98
        got = store.read(np.array([1, 2]), np.full(2, UNTIL_ALL, dtype=np.int64))
    assert got.video_ids[:got.offsets[1]].tolist() == [10, 15, 20, 21, 30, 31, 40]
    assert got.timestamps_ms[:got.offsets[1]].tolist() == [T0 + m * MINUTE for m in (10, 15, 20, 20, 30, 30, 40)]
    assert got.video_ids[got.offsets[1]:].tolist() == [98, 99]
