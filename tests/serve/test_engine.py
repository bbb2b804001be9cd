"""A node's scoring engine without HTTP: parity with InferenceSession, the tier of each visit, refusals, shutdown."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmark.harness.visits import visit_queries
from data.dataset import InferenceDataset
from helpers import assert_logits_close, make_cache
from kvcache import KVCacheRequestError
from model.checkpoint import load_checkpoint
from model.inference import InferenceSession
from serve.engine import EngineConfig, open_engine
from serve.protocol import RequestError, ScoreQuery


def engine_for(artifacts, **overrides):
    processed, checkpoint = artifacts
    return open_engine(EngineConfig(str(processed), str(checkpoint), async_offload=False, **overrides))


def offline_logits(artifacts, indices, batch_size=4) -> list[torch.Tensor]:
    """What the offline replay gives each visit (one tensor per request, in order)."""
    processed, checkpoint = artifacts
    dataset = InferenceDataset(processed)
    model = load_checkpoint(checkpoint).model
    session = InferenceSession(model, dataset, kv_cache=make_cache(model.config, num_pages=512))
    out = {}
    for batch in dataset.batches(indices, batch_size):
        result = session.serve(batch)
        offsets = np.concatenate([[0], np.cumsum(result.candidate_lengths)])
        for b, request in enumerate(result.request_ids.tolist()):
            out[request] = result.logits[offsets[b]:offsets[b + 1]]
    return [out[i] for i in np.asarray(indices).tolist()]


def test_engine_scores_equal_the_offline_replay_and_report_reuse(serving_artifacts):
    engine = engine_for(serving_artifacts)
    try:
        indices = engine.history.request_indices(max_requests=60)
        expected = offline_logits(serving_artifacts, indices)
        queries = visit_queries(engine.history, indices)
        results = []
        for batch in engine.history.batches(indices, 5):
            results += engine.score_batch([queries[int(np.flatnonzero(indices == i)[0])] for i in batch])
        for got, want in zip(results, expected):
            assert_logits_close(torch.tensor(got.logits), want)
        tiers = [r.cache.tier for r in results]
        assert tiers.count("device") > 0 and set(tiers) <= {"device", "none"}  # a lone node: device or nothing
        assert all(r.cache.tokens_reused > 0 for r in results if r.cache.tier == "device")
        assert all(r.cache.tokens_reused == 0 for r in results if r.cache.tier == "none")
        assert sum(r.cache.tokens_reused for r in results) == engine.cache.stats().tokens_reused
    finally:
        engine.shutdown()


def returning_user(dataset, visits=4) -> np.ndarray:
    """The first `visits` requests of a user whose history at the last of them still fits one window."""
    req = dataset.requests
    for user in np.unique(req.user_id).tolist():
        rows = np.flatnonzero(req.user_id == user)[:visits]
        if len(rows) == visits and req.end[rows[-1]] < 200:
            return rows
    raise AssertionError("no user with enough short visits")


def test_tiers_across_two_nodes_sharing_redis(serving_artifacts, private_redis_server):
    a = engine_for(serving_artifacts, redis_url=private_redis_server.url)
    b = engine_for(serving_artifacts, redis_url=private_redis_server.url)
    try:
        first, second, third, fourth = visit_queries(a.history, returning_user(a.history))
        expected = offline_logits(serving_artifacts, returning_user(a.history), batch_size=1)
        got = [a.score_batch([first])[0]]
        assert got[0].cache.tier == "none"
        got.append(b.score_batch([second])[0])  # another node: reloads what `a` wrote through to Redis
        assert got[1].cache.tier == "shared" and got[1].cache.shared_reload_bytes > 0
        got.append(a.score_batch([third])[0])  # back on `a`: its device copy is one visit behind Redis
        assert got[2].cache.tier == "device"
        # ... so it recomputes what `b` computed (the history part of b's tokens).
        assert got[2].cache.tokens_recomputed == got[1].cache.tokens_computed - len(second.candidate_video_ids) > 0
        a.cache.evict_kv_cache()  # device -> host memory
        got.append(a.score_batch([fourth])[0])
        assert got[3].cache.tier == "host" and got[3].cache.shared_reload_bytes == 0
        for result, want in zip(got, expected):
            assert_logits_close(torch.tensor(result.logits), want)
    finally:
        a.shutdown()
        b.shutdown()


def test_too_many_candidates_is_refused_before_the_queue(serving_artifacts):
    engine = engine_for(serving_artifacts, max_candidates=8)
    try:
        good = visit_queries(engine.history, engine.history.request_indices(max_requests=1))[0]
        engine.validate(good)
        with pytest.raises(RequestError) as caught:
            engine.validate(ScoreQuery(good.user_id, good.request_time_ms, tuple(range(9))))
        assert (caught.value.status, caught.value.code) == (422, "too_many_candidates")
        assert "at most 8" in caught.value.message
    finally:
        engine.shutdown()


def test_a_visit_without_history_fails_alone_and_its_batch_is_scored(serving_artifacts):
    engine = engine_for(serving_artifacts)
    try:
        first, second = visit_queries(engine.history, engine.history.request_indices(max_requests=2))
        alone = engine.score_batch([first])[0]
        engine.reset_cache()
        results = engine.score_batch([first, ScoreQuery(10**9, second.request_time_ms, second.candidate_video_ids)])
        assert results[0].logits == alone.logits
        assert isinstance(results[1], RequestError)
        assert (results[1].status, results[1].code) == (422, "unknown_user")
        assert "user 1000000000 has no events" in results[1].message
        no_history = engine.score_batch([ScoreQuery(second.user_id, 0, second.candidate_video_ids)])[0]
        assert (no_history.code, "no events before request_time_ms=0" in no_history.message) == ("no_history", True)
    finally:
        engine.shutdown()


def _one_visit_per_user(engine, users=3) -> list[ScoreQuery]:
    queries, seen = [], set()
    for q in visit_queries(engine.history, engine.history.request_indices(max_requests=200)):
        if q.user_id not in seen:
            queries.append(q)
            seen.add(q.user_id)
    return queries[:users]


def _refuse_user_while_cached(engine, user_id, recovers: bool) -> list[int]:
    """Fault injection at the session seam: the cache refuses every batch holding `user_id` (as a race
    between two callers once did), until the engine drops the user's cache if `recovers`."""
    score_over, invalidate = engine.session.score_over, engine.cache.invalidate_kv_cache
    poisoned, dropped = [True], []

    def refusing(histories, visits):
        if poisoned[0] and any(v.user_id == user_id for v in visits):
            raise KVCacheRequestError(f"User {user_id}: The input sequence has overlapping tokens from 192 to 241")
        return score_over(histories, visits)

    def invalidating(users):
        dropped.extend(users)
        poisoned[0] = poisoned[0] and not (recovers and user_id in users)
        return invalidate(users)

    engine.session.score_over, engine.cache.invalidate_kv_cache = refusing, invalidating
    return dropped


@pytest.mark.parametrize("recovers", [True, False])
def test_one_users_cache_refusal_fails_at_most_that_visit(serving_artifacts, recovers):
    engine = engine_for(serving_artifacts)
    try:
        queries = _one_visit_per_user(engine)
        alone = [engine.score_batch([q])[0].logits for q in queries]
        engine.reset_cache()
        dropped = _refuse_user_while_cached(engine, queries[1].user_id, recovers)
        results = engine.score_batch(queries)
        assert [r.logits for r in (results[0], results[2])] == [alone[0], alone[2]]
        assert dropped == [queries[1].user_id]  # the refused user's cache only, once
        if recovers:
            assert results[1].logits == alone[1] and results[1].cache.tier == "none"
        else:
            assert isinstance(results[1], RequestError)
            assert (results[1].status, results[1].code) == (500, "kv_cache_error")
            assert f"user {queries[1].user_id}: User {queries[1].user_id}: The input sequence" in results[1].message
    finally:
        engine.shutdown()


def test_shutdown_offloads_device_kv_to_the_shared_tier(serving_artifacts, private_redis_server):
    dataset = InferenceDataset(serving_artifacts[0])
    first, second = visit_queries(dataset, returning_user(dataset, 2))
    leaving = engine_for(serving_artifacts, redis_url=private_redis_server.url, offload_each_visit=False)
    served = leaving.score_batch([first])[0]
    staying = engine_for(serving_artifacts, redis_url=private_redis_server.url)
    try:
        assert staying.cache.get_user_kvdata_info([first.user_id])[1].item() == 0  # nothing offloaded yet
        leaving.shutdown()
        result = staying.score_batch([second])[0]
        assert result.cache.tier == "shared"
        assert result.cache.tokens_reused == served.cache.tokens_computed - len(first.candidate_video_ids)
    finally:
        staying.shutdown()


def test_a_lossless_codec_on_the_tiers_serves_the_same_scores(serving_artifacts):
    """`EngineConfig.kv_codec` (the node's --kv_codec): returning users reloaded from `zstd-channel`
    host memory score as the offline replay does."""
    engine = engine_for(serving_artifacts, kv_codec="zstd-channel")
    try:
        assert engine.cache.config.kv_codec == "zstd-channel"
        rows = returning_user(engine.history)
        expected = offline_logits(serving_artifacts, rows, batch_size=1)
        got = []
        for query in visit_queries(engine.history, rows):
            engine.cache.evict_kv_cache()  # every visit after the first reloads from the host tier
            got.append(engine.score_batch([query])[0])
        assert [r.cache.tier for r in got[1:]] == ["host"] * (len(rows) - 1)
        for result, want in zip(got, expected):
            assert_logits_close(torch.tensor(result.logits), want)
    finally:
        engine.shutdown()


def test_the_node_refuses_an_unknown_codec_before_the_slow_start(capsys):
    from serve.node import main

    with pytest.raises(SystemExit) as refused:
        main(["--checkpoint", "c", "--port", "8001", "--data_dir", "d", "--kv_codec", "lz77"])
    assert refused.value.code == 2
    assert "--kv_codec" in capsys.readouterr().err
