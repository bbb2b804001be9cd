"""InferenceSession on preprocessed data: parity, cache tags (stale-data guard), re-planning."""
from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.dataset import InferenceDataset
from helpers import assert_logits_close, build_processed, make_cache, sensitive_model
from kvcache.testing import append_batch, new_token_kv, token_kv
from model.config import config_for_dataset
from model.inference import InferenceSession


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    return build_processed(tmp_path_factory.mktemp("session"))


@pytest.fixture()
def setup(processed):
    dataset = InferenceDataset(processed)  # fresh per test: some tests rewrite its events
    cfg = config_for_dataset("tiny", dataset)
    return dataset, cfg, sensitive_model(cfg, 0)


def replay(session, dataset, indices, batch_size=4):
    return [session.serve(b) for b in dataset.batches(indices, batch_size)]


def test_session_with_cache_matches_full_recompute(setup):
    dataset, cfg, model = setup
    indices = dataset.request_indices(max_requests=80)
    cache = make_cache(cfg, num_pages=256)
    cached = replay(InferenceSession(model, dataset, kv_cache=cache), dataset, indices)
    full = replay(InferenceSession(model, dataset), dataset, indices)
    for c, f in zip(cached, full):
        assert np.array_equal(c.request_ids, f.request_ids)
        assert_logits_close(c.logits, f.logits)
    assert sum(r.tokens_reused for r in cached) > 0
    assert sum(r.tokens_computed for r in cached) < sum(r.tokens_computed for r in full)


def user_with_two_visits(dataset):
    req = dataset.requests
    users, counts = np.unique(req.user_id, return_counts=True)
    user = int(users[np.argmax(counts)])
    first, second = np.flatnonzero(req.user_id == user)[:2]
    return user, first, second


def cache_other_tokens(cache, prepare, user, start, length, salt):
    """What another caller does: commit K/V of its own (`salt`) for the user's tokens [start, start + length)."""
    meta = prepare([user], [start], [length])
    layout = cache.config.page_layout
    append_batch(cache, meta, new_token_kv(layout, meta, [start], lambda u, pos: token_kv(layout, u, pos, salt)))
    cache.commit(meta)


def rewrite_first_event(processed, out, user):
    """A copy of the preprocessed output in which upstream changed the user's event 0."""
    shutil.copytree(processed, out)
    table = pq.read_table(out / "sequences.parquet")
    videos = table.column("video_ids").to_pylist()
    row = table.column("user_id").to_pylist().index(user)
    videos[row][0] += 1
    column = pa.array(videos, type=table.schema.field("video_ids").type)
    pq.write_table(table.set_column(table.column_names.index("video_ids"), "video_ids", column), out / "sequences.parquet")
    return InferenceDataset(out)


def test_rewritten_history_is_detected_and_recomputed(setup, processed, tmp_path):
    dataset, cfg, model = setup
    user, first, second = user_with_two_visits(dataset)
    cache = make_cache(cfg, num_pages=256)
    InferenceSession(model, dataset, kv_cache=cache).serve(np.array([first]))
    rewritten = rewrite_first_event(processed, tmp_path / "rewritten", user)
    session = InferenceSession(model, rewritten, kv_cache=cache)
    result = session.serve(np.array([second]))
    assert session.tag_mismatches == 1 and result.tokens_reused == 0
    assert_logits_close(result.logits, InferenceSession(model, rewritten).serve(np.array([second])).logits)
    # The unchanged history is still served from the cache on the next visit.
    assert session.serve(np.array([np.flatnonzero(rewritten.requests.user_id == user)[2]])).tokens_reused > 0


def test_cache_written_by_another_model_is_not_reused(setup):
    dataset, cfg, model = setup
    _user, first, second = user_with_two_visits(dataset)
    cache = make_cache(cfg, num_pages=256)
    InferenceSession(model, dataset, kv_cache=cache).serve(np.array([first]))
    other = sensitive_model(cfg, 1)
    session = InferenceSession(other, dataset, kv_cache=cache)
    result = session.serve(np.array([second]))
    assert session.tag_mismatches == 1
    assert_logits_close(result.logits, InferenceSession(other, dataset).serve(np.array([second])).logits)


def test_data_lost_between_plan_and_prepare_is_replanned(setup, monkeypatch):
    dataset, cfg, model = setup
    user, first, second = user_with_two_visits(dataset)
    cache = make_cache(cfg, num_pages=256)
    session = InferenceSession(model, dataset, kv_cache=cache)
    session.serve(np.array([first]))
    prepare = cache.prepare_kv_cache
    calls = []

    def losing_prepare(*args, **kwargs):
        if not calls:  # another caller evicts the user from every tier right after our plan
            cache.invalidate_kv_cache([user])
        calls.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(cache, "prepare_kv_cache", losing_prepare)
    result = session.serve(np.array([second]))
    assert len(calls) == 2
    assert_logits_close(result.logits, InferenceSession(model, dataset).serve(np.array([second])).logits)


def test_same_length_rewrite_between_plan_and_prepare_is_replanned(setup, monkeypatch):
    """Another caller replaces the user's cached tokens by others of the same range after our plan:
    lengths still agree, the commit generation does not; the visit is re-planned, the foreign tokens
    fail their tag and the window is recomputed."""
    dataset, cfg, model = setup
    user, first, second = user_with_two_visits(dataset)
    cache = make_cache(cfg, num_pages=256)
    session = InferenceSession(model, dataset, kv_cache=cache)
    session.serve(np.array([first]))
    prepare = cache.prepare_kv_cache
    calls = []

    def rewriting_prepare(*args, **kwargs):
        if not calls:
            (start,), (length,) = (t.tolist() for t in cache.get_user_kvdata_info([user]))
            cache.invalidate_kv_cache([user])
            cache_other_tokens(cache, prepare, user, start, length, salt=7)
        calls.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(cache, "prepare_kv_cache", rewriting_prepare)
    result = session.serve(np.array([second]))
    assert len(calls) == 2
    assert_logits_close(result.logits, InferenceSession(model, dataset).serve(np.array([second])).logits)


def test_tokens_cached_by_another_caller_right_after_our_invalidation_are_replanned(setup, monkeypatch):
    """The plan drops a user's cache (the visit's history ends before what is cached) and computes the
    window from nothing; another caller caches tokens for the user in between. The prepare must see
    that the cache is no longer empty (stale, re-plan), never continue or overlap those tokens."""
    dataset, cfg, model = setup
    user, first, second = user_with_two_visits(dataset)
    cache = make_cache(cfg, num_pages=256)
    session = InferenceSession(model, dataset, kv_cache=cache)
    session.serve(np.array([second]))  # the cache now holds more than the first visit's window
    (start,), (length,) = (t.tolist() for t in cache.get_user_kvdata_info([user]))
    invalidate, prepare = cache.invalidate_kv_cache, cache.prepare_kv_cache
    racing = []

    def invalidate_then_race(users):
        invalidate(users)
        if not racing:
            racing.append(1)
            cache_other_tokens(cache, prepare, user, start, length, salt=3)

    monkeypatch.setattr(cache, "invalidate_kv_cache", invalidate_then_race)
    result = session.serve(np.array([first]))
    assert racing
    assert_logits_close(result.logits, InferenceSession(model, dataset).serve(np.array([first])).logits)


def test_cache_of_another_geometry_is_refused(setup):
    dataset, cfg, model = setup
    with pytest.raises(ValueError, match="does not match the model"):
        InferenceSession(model, dataset, kv_cache=make_cache(cfg.replace(num_layers=cfg.num_layers + 1)))


def test_a_batch_with_one_user_twice_is_refused(setup):
    dataset, cfg, model = setup
    _user, first, second = user_with_two_visits(dataset)
    cache = make_cache(cfg)
    with pytest.raises(ValueError, match="at most once"):
        InferenceSession(model, dataset, kv_cache=cache).serve(np.array([first, second]))
    assert cache.stats().pages_in_use == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_bf16_session_close_to_fp32(setup, dtype):
    dataset, cfg, model = setup
    indices = dataset.request_indices(max_requests=30)
    full = replay(InferenceSession(model, dataset), dataset, indices)
    low = sensitive_model(cfg, 0).to(dtype)
    cached = replay(InferenceSession(low, dataset, kv_cache=make_cache(cfg, dtype=dtype)), dataset, indices)
    for c, f in zip(cached, full):
        assert_logits_close(c.logits, f.logits, rel=5e-2)


def _score_requests_for(dataset, indices):
    """The dataset's visits as ad-hoc requests: user, request time and the same candidates."""
    from model.visit import Visit

    req, out = dataset.requests, []
    for i in indices:
        batch = dataset.make_batch(np.array([i]), np.array([0]), np.array([0]))
        out.append(Visit(int(req.user_id[i]), int(req.time_ms[i]), batch.candidate_video_ids))
    return out


def test_score_equals_serve_for_the_same_visits_cached_and_full(setup):
    dataset, cfg, model = setup
    indices = dataset.request_indices(max_requests=60)
    batches = list(dataset.batches(indices, 4))
    served = replay(InferenceSession(model, dataset, kv_cache=make_cache(cfg, num_pages=256)), dataset, indices)
    for session in (InferenceSession(model, dataset, kv_cache=make_cache(cfg, num_pages=256)),
                    InferenceSession(model, dataset)):
        for batch, expected in zip(batches, served):
            scored = session.score(_score_requests_for(dataset, batch))
            assert np.array_equal(scored.user_ids, expected.user_ids)
            assert np.array_equal(scored.history_lengths, expected.history_lengths)
            assert scored.labels is None and (scored.request_ids == -1).all()
            assert_logits_close(scored.logits, expected.logits)


@pytest.mark.parametrize("change, message", [
    (lambda r: r.__class__(10**9, r.request_time_ms, r.candidate_video_ids), "user 1000000000 has no events"),
    (lambda r: r.__class__(r.user_id, 0, r.candidate_video_ids), "no events before request_time_ms=0"),
    (lambda r: r.__class__(r.user_id, r.request_time_ms, np.array([], dtype=np.int64)), "candidate_video_ids is empty"),
    (lambda r: r.__class__(r.user_id, r.request_time_ms, np.array([3, -2])), "must be non-negative integers"),
])
def test_bad_score_requests_are_refused_and_change_nothing(setup, change, message):
    dataset, cfg, model = setup
    cache = make_cache(cfg, num_pages=256)
    session = InferenceSession(model, dataset, kv_cache=cache)
    good = _score_requests_for(dataset, dataset.request_indices(max_requests=3))
    session.score(good[:1])
    before = cache.stats()
    with pytest.raises(ValueError, match=message):
        session.score([good[1], change(good[2])])
    assert cache.stats() == before
