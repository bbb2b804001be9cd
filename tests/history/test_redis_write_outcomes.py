"""What the Redis history store's write answers say is what happened: an append the server took and did
not answer in time is "outcome unknown" (never "nothing stored"), and its retry with the same batch_id
tells the outcome; a server switched to lose acknowledged writes at run time gets no more appends."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from benchmark.harness.launch import free_port
from helpers import T0
from history import AppendOutcomeUnknownError, EventBatch, HistoryUnavailableError
from history.redis_store import RedisHistoryStore
from serve.ingest import Ingestor
from serve.metrics import Registry
from serve.protocol import RequestError

NO_RECHECK_S = 3600.0  # these tests check the fsync settings themselves


def batch_of(first_video: int, n: int = 5) -> EventBatch:
    return EventBatch.from_columns({"user_id": np.arange(n) % 2, "video_id": first_video + np.arange(n),
                                    "time_ms": T0 + np.arange(n)})


def stored_videos(store: RedisHistoryStore) -> list[int]:
    return sorted(store.read(np.array([0, 1]), np.array([T0 + 10**9] * 2)).video_ids.tolist())


def test_an_append_stalled_past_the_timeout_is_outcome_unknown_and_its_retry_tells(make_redis_server):
    server = make_redis_server(durable=True)
    store = RedisHistoryStore.from_url(server.url, timeout_s=0.5, fsync_check_interval_s=NO_RECHECK_S)
    batch = batch_of(100)
    server.pause()
    try:
        with pytest.raises(AppendOutcomeUnknownError, match="may have been stored; retry it with the same batch_id"):
            store.append(batch, batch_id="b-1")
    finally:
        server.resume()
    retried = store.append(batch, batch_id="b-1")  # stored once, by whichever of the two ran first
    assert retried.replayed or retried.appended == len(batch)
    assert stored_videos(store) == list(range(100, 105)) and store.num_events() == len(batch)
    store.close()


def test_the_node_answers_an_unknown_outcome_as_such(make_redis_server):
    server = make_redis_server(durable=True)
    store = RedisHistoryStore.from_url(server.url, timeout_s=0.5, fsync_check_interval_s=NO_RECHECK_S)
    ingestor = Ingestor(store, Registry())
    server.pause()
    try:
        with pytest.raises(RequestError) as caught:
            asyncio.run(ingestor.append(batch_of(200), "b-2"))
    finally:
        server.resume()
    assert (caught.value.status, caught.value.code) == (503, "outcome_unknown")
    assert "nothing stored" not in caught.value.message
    ingestor.close()
    store.close()


def test_an_append_that_never_left_says_nothing_was_stored():
    store = RedisHistoryStore.from_url(f"redis://127.0.0.1:{free_port()}/0", require_fsync=False, timeout_s=2)
    with pytest.raises(HistoryUnavailableError, match="nothing stored") as caught:
        store.append(batch_of(300), batch_id="b-3")
    assert not isinstance(caught.value, AppendOutcomeUnknownError)
    store.close()


def test_a_server_switched_to_everysec_at_run_time_gets_no_more_appends(make_redis_server):
    server = make_redis_server(durable=True)
    store = RedisHistoryStore.from_url(server.url, fsync_check_interval_s=0.0)  # check before every append
    store.append(batch_of(400))
    server.client().config_set("appendfsync", "everysec")
    with pytest.raises(HistoryUnavailableError, match=r"refusing writes, nothing stored: .*appendfsync=everysec"):
        store.append(batch_of(500))
    assert stored_videos(store) == list(range(400, 405))
    server.client().config_set("appendfsync", "always")
    assert store.append(batch_of(500)).appended == 5
    store.close()


def test_the_fsync_settings_are_read_again_only_once_the_interval_passed(make_redis_server):
    server = make_redis_server(durable=True)
    store = RedisHistoryStore.from_url(server.url, fsync_check_interval_s=NO_RECHECK_S)
    server.client().config_set("appendfsync", "everysec")
    assert store.append(batch_of(600)).appended == 5  # within the interval: one CONFIG GET per interval at most
    store.durability.check_interval_s = 0.0
    with pytest.raises(HistoryUnavailableError, match="appendfsync=everysec"):
        store.append(batch_of(700))
    server.client().config_set("appendfsync", "always")
    store.close()
