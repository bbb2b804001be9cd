"""The library served live: visits over a history store that receives the later events as they happen
score exactly as the offline replay of the same visits over the whole dataset."""
from __future__ import annotations

import numpy as np
import pytest

from benchmark.harness.live_traffic import live_steps, visits_of
from data.dataset import InferenceDataset
from helpers import assert_logits_close, build_processed, make_cache, sensitive_model
from history.bootstrap import bootstrap_from_output, dataset_events
from history.events import EventBatch
from history.sqlite_store import SQLiteHistoryStore
from model.config import config_for_dataset
from model.inference import InferenceSession
from model.visit import Visit


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    return build_processed(tmp_path_factory.mktemp("live"))


@pytest.fixture()
def setup(processed, tmp_path):
    dataset = InferenceDataset(processed)
    cfg = config_for_dataset("tiny", dataset)
    times = dataset.requests.time_ms
    split = int(times[len(times) // 3])  # the first third of the visits' period is the bootstrap
    store = SQLiteHistoryStore(tmp_path / "history.sqlite")
    bootstrap_from_output(store, processed, until_ms=split, progress=False)
    yield dataset, cfg, sensitive_model(cfg, 0), store, split
    store.close()


def offline(model, dataset, indices):
    """Full recompute of the dataset's visits, one batch at a time: logits per request index."""
    session = InferenceSession(model, dataset)
    out = {}
    for batch in dataset.batches(indices, 4):
        result = session.serve(batch)
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        out.update({int(r): result.logits[offsets[b]:offsets[b + 1]] for b, r in enumerate(batch)})
    return out


def test_live_visits_over_a_store_equal_the_offline_replay(setup):
    dataset, cfg, model, store, split = setup
    steps = list(live_steps(dataset, split, batch_size=4, max_requests=60))
    expected = offline(model, dataset, np.concatenate([s.requests for s in steps]))
    session = InferenceSession(model, store, kv_cache=make_cache(cfg, num_pages=256))
    reused = 0
    for step in steps:
        store.append(step.events)
        result = session.score(visits_of(dataset, step.requests))
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        for b, r in enumerate(step.requests.tolist()):
            assert_logits_close(result.logits[offsets[b]:offsets[b + 1]], expected[r])
        reused += result.tokens_reused
    assert reused > 0  # returning users were served from their cached K/V


def test_new_events_carried_by_visits_retries_and_odd_batches_change_nothing(setup):
    """The same stream, its events carried inline by the visits of their users in random pieces, each
    piece sent twice and some pieces ahead of time: the store and the scores come out the same."""
    dataset, cfg, model, store, split = setup
    rng = np.random.default_rng(5)
    steps = list(live_steps(dataset, split, batch_size=3, max_requests=45))
    expected = offline(model, dataset, np.concatenate([s.requests for s in steps]))
    session = InferenceSession(model, store, kv_cache=make_cache(cfg, num_pages=256))
    for step in steps:
        visits = visits_of(dataset, step.requests)
        users = {v.user_id for v in visits}
        mine = np.isin(step.events.user_id, list(users))
        others = step.events.take(~mine)
        for lo in range(0, len(others), 1 + int(rng.integers(0, 40))):  # others' events: random batch sizes
            piece = others.take(slice(lo, lo + 40))
            store.append(piece)
            if rng.random() < 0.3:
                assert store.append(piece).appended == 0  # a retry stores nothing
        inline = []
        for v in visits:
            own = step.events.take(step.events.user_id == v.user_id)
            inline.append(Visit(v.user_id, v.request_time_ms, v.candidate_video_ids,
                                EventBatch.concat([own, own.take(slice(0, len(own) // 2))])))  # with duplicates
        result = session.score(inline)
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        for b, r in enumerate(step.requests.tolist()):
            assert_logits_close(result.logits[offsets[b]:offsets[b + 1]], expected[r])
    everything = dataset_events(dataset)
    sent = everything.time_ms < int(dataset.requests.time_ms[steps[-1].requests].max())
    assert store.num_events() == int(sent.sum())


def test_a_late_event_is_counted_and_the_next_visit_recomputes_over_it(setup):
    dataset, cfg, model, store, split = setup
    steps = list(live_steps(dataset, split, batch_size=1, max_requests=200))
    session = InferenceSession(model, store, kv_cache=make_cache(cfg, num_pages=256))
    seen: dict[int, int] = {}
    for step in steps:  # serve until a user comes back
        store.append(step.events)
        visit = visits_of(dataset, step.requests)[0]
        session.score([visit])
        if visit.user_id in seen:
            break
        seen[visit.user_id] = visit.request_time_ms
    else:
        pytest.fail("no returning user in the stream")
    user, first_visit_ms = visit.user_id, seen[visit.user_id]
    old = store.read(np.array([user]), np.array([first_visit_ms]))
    late = EventBatch.from_columns({"user_id": [user], "video_id": [int(old.video_ids[-1])],
                                    "time_ms": [int(old.timestamps_ms[0]) + 1], "is_click": [1]})
    assert store.append(late).late == 1
    mismatches = session.tag_mismatches
    again = Visit(user, visit.request_time_ms + 1, visit.candidate_video_ids)
    cached = session.score([again])
    assert session.tag_mismatches == mismatches + 1  # the cached window no longer matches the history
    assert_logits_close(cached.logits, InferenceSession(model, store).score([again]).logits)
