"""Retention (history/retention.py): a store that keeps each user's last N events and the counters of
the rest scores every visit as the store that keeps everything, while holding at most users x N events."""
from __future__ import annotations

import numpy as np
import pytest

from benchmark.harness.live_traffic import live_steps, visits_of
from data.dataset import InferenceDataset
from helpers import assert_logits_close, build_processed, make_cache, sensitive_model
from history.bootstrap import bootstrap_from_output
from history.events import EventBatch
from history.retention import Retention, RetentionError, fold_counts, stand_ins
from history.sqlite_store import SQLiteHistoryStore
from model.config import config_for_dataset
from model.inference import InferenceSession

SLACK_EVENTS = 8  # events a visit may find stored after its time


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    return build_processed(tmp_path_factory.mktemp("retention"))


def small_window_config(dataset):
    """The tiny preset with a window short enough that the data's users outgrow it many times over."""
    cfg = config_for_dataset("tiny", dataset)
    return cfg.replace(max_seq_len=cfg.num_prefix_tokens + 24, window_stride=8, counter_buckets=4)


def test_bounded_and_unbounded_stores_give_the_same_logits_and_the_bounded_one_stays_bounded(processed, tmp_path):
    dataset = InferenceDataset(processed)
    cfg = small_window_config(dataset)
    model = sensitive_model(cfg, 0)
    retention = Retention.for_model(cfg, SLACK_EVENTS)
    retention.check_model(cfg)
    split = int(dataset.requests.time_ms[len(dataset.requests.time_ms) // 3])
    stores = {name: SQLiteHistoryStore(tmp_path / f"{name}.sqlite") for name in ("bounded", "unbounded")}
    for store in stores.values():
        bootstrap_from_output(store, processed, until_ms=split, progress=False)
    assert stores["bounded"].set_retention(retention) > 0  # the bootstrap's long histories are folded at once
    sessions = {name: InferenceSession(model, store, kv_cache=make_cache(cfg, num_pages=256))
                for name, store in stores.items()}
    visits = 0
    for step in live_steps(dataset, split, batch_size=1, max_requests=120):  # visits in time order, as served
        results = {}
        for name, store in stores.items():
            store.append(step.events)
            results[name] = sessions[name].score(visits_of(dataset, step.requests))
        assert_logits_close(results["bounded"].logits, results["unbounded"].logits, rel=1e-4)
        visits += len(step.requests)
    bounded, unbounded = stores["bounded"], stores["unbounded"]
    users = len(unbounded.stored_user_ids())
    assert visits == 120 and len(bounded.stored_user_ids()) == users
    assert bounded.num_events() <= users * retention.keep_events < unbounded.num_events()
    long_users = [u for u in unbounded.stored_user_ids().tolist()
                  if len(unbounded.read(np.array([u]), np.array([2**62])).video_ids) > retention.keep_events]
    assert long_users  # the replay went through folded histories, not only short ones
    for store in stores.values():
        store.close()


@pytest.fixture()
def folded_store(tmp_path):
    """A store with retention (keep 4, window 3) and one user whose first 3 of 7 events were folded."""
    store = SQLiteHistoryStore(tmp_path / "h.sqlite")
    store.set_retention(Retention(keep_events=4, window_events=3))
    events = EventBatch.from_columns({"user_id": [7] * 7, "video_id": [1, 2, 1, 3, 4, 5, 6],
                                      "time_ms": [1_650_000_000_000 + 1000 * i for i in range(7)],
                                      "is_click": [1, 0, 0, 1, 0, 0, 1]})
    assert store.append(events).appended == 7
    yield store, events
    store.close()


def test_a_read_puts_stand_ins_for_the_folded_events_that_count_the_same(folded_store):
    store, events = folded_store
    assert store.num_events() == 4
    read = store.read(np.array([7]), np.array([2**62]))
    assert len(read.video_ids) == 7 and (read.video_ids[3:] == events.video_id[3:]).all()
    assert sorted(read.video_ids[:3].tolist()) == [1, 1, 2]  # per-video: the user x video counters
    assert (read.action_weights[:3] & 1).sum() == 1  # clicks among the folded: the user's click counter
    assert (read.timestamps_ms[:3] == events.time_ms[2]).all()
    counts = store.counts(np.array([1, 2, 3]), np.full(3, 2**62))
    assert counts[:, :2].tolist() == [[2, 1], [1, 0], [1, 1]]  # folded video counters kept


def test_what_a_folded_store_cannot_answer_is_refused_naming_it_and_changes_nothing(folded_store):
    store, events = folded_store
    with pytest.raises(RetentionError, match=r"user 7: a visit at .* lies in the folded past"):
        store.read(np.array([7]), np.array([events.time_ms[1]]))
    with pytest.raises(RetentionError, match="video 1: counters at"):
        store.counts(np.array([1]), np.array([events.time_ms[2]]))
    before = store.read(np.array([7]), np.array([2**62]))
    copy = store.append(events.take(slice(0, 2)))  # a folded event sent again is taken as stored
    assert (copy.appended, copy.duplicates) == (0, 2) and store.num_events() == 4
    after = store.read(np.array([7]), np.array([2**62]))
    assert all((a == b).all() for a, b in zip(before, after))
    with pytest.raises(RetentionError, match="window needs 3"):  # 2 kept events before: under the window
        store.read(np.array([7]), np.array([events.time_ms[5]]))


def test_stand_ins_and_fold_counts_are_inverse_and_the_rule_checks_the_model(processed):
    rng = np.random.default_rng(0)
    videos, weights = rng.integers(0, 5, 50), rng.integers(0, 256, 50)
    folded_videos, counts = fold_counts(videos, weights)
    again = fold_counts(*stand_ins(folded_videos, counts))
    assert (again[0] == folded_videos).all() and (again[1] == counts).all()
    cfg = small_window_config(InferenceDataset(processed))
    with pytest.raises(ValueError, match="the model reads up to"):
        Retention(keep_events=100, window_events=cfg.max_seq_len - cfg.num_prefix_tokens).check_model(cfg)
    with pytest.raises(ValueError, match=r"keep_events .* must be >= window_events"):
        Retention(keep_events=2, window_events=3)


def test_the_command_line_gives_a_store_its_rule(tmp_path, capsys):
    from history.set_retention import main

    path = tmp_path / "h.sqlite"
    SQLiteHistoryStore(path).close()
    assert main(["--store", f"sqlite://{path}", "--keep_events", "10", "--window_events", "5"]) == 0
    with SQLiteHistoryStore(path) as store:  # the rule lives in the store: every opener folds by it
        assert store.retention == Retention(10, 5)
    assert "keeps each user's last 10 events" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--store", f"sqlite://{path}", "--keep_events", "4", "--window_events", "5"])


def test_a_folded_store_is_not_exported_as_if_its_stand_ins_were_events(folded_store, tmp_path):
    from history.export import ExportError, export_store

    store, _ = folded_store
    with pytest.raises(ExportError, match="an export would hold stand-ins"):
        export_store(store, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
