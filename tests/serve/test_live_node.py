"""Live traffic through real processes: nodes over one SQLite history store, a router in front.

Events go in through POST /events (and inline in /score), visits are scored over what was stored:
the same logits as the offline replay of the same visits. Retries store nothing twice, bad input is
refused with the field named and stores nothing, a user never seen before is served, and a node
killed with SIGKILL while it ingests loses no acknowledged event: the user's next visit, on the other
node, sees every one of them.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmark.harness.launch import start_node, start_router, wait_healthy
from benchmark.harness.live_traffic import live_steps
from benchmark.harness.visits import visit_queries
from data.dataset import InferenceDataset
from helpers import assert_logits_close, offline_logits
from history.bootstrap import bootstrap_from_output
from history.sqlite_store import SQLiteHistoryStore
from model.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0
NODE_ARGS = ["--kv_pages", "512", "--max_wait_ms", "1", "--sync_offload", "--max_candidates", "64", "--max_events", "500"]
BODY_TIMEOUT_S = 3.0  # the nodes' header and body deadlines: short, the test's waits are ten times longer
LIVE_NODE_ARGS = [*NODE_ARGS, "--body_timeout_s", str(BODY_TIMEOUT_S), "--header_timeout_s", str(BODY_TIMEOUT_S)]


def post(url: str, path: str, doc: object) -> tuple[int, dict]:
    body = json.dumps(doc).encode()
    request = urllib.request.Request(f"{url}{path}", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class LiveCluster:
    def __init__(self, tmp, artifacts):
        self.data_dir, self.checkpoint = artifacts
        self.dataset = InferenceDataset(self.data_dir)
        times = self.dataset.requests.time_ms
        self.split = int(times[len(times) // 3])
        self.store_path = tmp / "history.sqlite"
        with SQLiteHistoryStore(self.store_path) as store:
            bootstrap_from_output(store, self.data_dir, until_ms=self.split, progress=False)
        self.url = f"sqlite://{self.store_path}"
        self.nodes = [start_node(None, self.checkpoint, tmp / "logs", extra_args=LIVE_NODE_ARGS, history_store=self.url)
                      for _ in range(2)]
        self.router = start_router([n.address for n in self.nodes], "sticky-hash", tmp / "logs",
                                   extra_args=["--probe_interval_s", "0.2"])
        wait_healthy([*self.nodes, self.router], timeout_s=240)
        self.model = load_checkpoint(self.checkpoint).model

    def num_events(self) -> int:
        with SQLiteHistoryStore(self.store_path) as store:
            return store.num_events()

    def stop(self) -> None:
        self.router.stop(timeout_s=10)
        for node in self.nodes:
            node.stop(timeout_s=30)


@pytest.fixture(scope="module")
def live(tmp_path_factory, serving_artifacts):
    cluster = LiveCluster(tmp_path_factory.mktemp("live"), serving_artifacts)
    yield cluster
    cluster.stop()


def test_events_then_visits_through_the_router_equal_the_offline_replay(live):
    steps = list(live_steps(live.dataset, live.split, batch_size=4, max_requests=40))
    indices = np.concatenate([s.requests for s in steps])
    expected = offline_logits(live.model, live.dataset, indices)
    reused = 0
    for step in steps:
        for lo in range(0, len(step.events), 200):
            status, answer = post(live.router.url, "/events", {"events": step.events.take(slice(lo, lo + 200)).to_records()})
            assert status == 200, answer
        for query in visit_queries(live.dataset, step.requests):
            status, answer = post(live.router.url, "/score", {
                "user_id": query.user_id, "request_time_ms": query.request_time_ms,
                "candidate_video_ids": list(query.candidate_video_ids)})
            assert status == 200, answer
            assert_logits_close(torch.tensor(answer["logits"]), expected[int(query.request_id)])
            reused += answer["cache"]["tokens_reused"]
    assert reused > 0


def test_retries_are_idempotent_and_conflicts_refused(live):
    node = live.nodes[0].url
    events = [{"user_id": 10**7, "video_id": 5, "time_ms": live.split + 1000 + i, "is_click": i % 2} for i in range(3)]
    assert post(node, "/events", {"events": events}) == (200, {"appended": 3, "duplicates": 0, "late": 0, "replayed": False})
    assert post(node, "/events", {"events": events})[1]["duplicates"] == 3  # a retry without an id: deduplicated
    first = post(node, "/events", {"events": events[:1], "batch_id": "b-1"})
    assert first == (200, {"appended": 0, "duplicates": 1, "late": 0, "replayed": False})
    assert post(live.nodes[1].url, "/events", {"events": events[:1], "batch_id": "b-1"})[1]["replayed"] is True
    before = live.num_events()
    status, answer = post(node, "/events", {"events": events[1:], "batch_id": "b-1"})
    assert (status, answer["error"]["code"]) == (409, "batch_conflict")
    assert live.num_events() == before


@pytest.mark.parametrize("doc, status, code, names", [
    ({"events": [{"user_id": 1, "video_id": 2, "time_ms": 1650000000000, "is_clik": 1}]}, 400, "invalid_event", "is_clik"),
    ({"events": [{"user_id": 1, "video_id": 2.5, "time_ms": 1650000000000}]}, 400, "invalid_event", "events[0].video_id"),
    ({"events": [{"user_id": 1, "video_id": 2, "time_ms": 10**16}]}, 400, "invalid_event", "time_ms"),
    ({"events": [{"user_id": 1, "video_id": 2, "time_ms": 4_000_000_000_000}]}, 400, "invalid_event", "future"),
    ({"events": [{"user_id": 1, "video_id": 2, "time_ms": 1650000000000, "is_like": 2}]}, 400, "invalid_event", "is_like"),
    ({"events": [{"user_id": -1, "video_id": 2, "time_ms": 1650000000000}]}, 400, "invalid_event", "user_id"),
    ({"events": [{"user_id": 1, "video_id": 2, "time_ms": 1650000000000}] * 501}, 413, "too_many_events", "501"),
    ({"events": [], "batch": 1}, 400, "unknown_field", "batch"),
    ({"events": [], "batch_id": "a\ud800"}, 400, "invalid_field", "batch_id holds a lone surrogate"),
    ({"user_id": 3, "request_time_ms": 1650000000000, "candidate_video_ids": [1],
      "events": [{"user_id": 4, "video_id": 2, "time_ms": 1650000000000}]}, 400, "invalid_event", "user_id"),
])
def test_bad_events_are_refused_naming_the_field_and_store_nothing(live, doc, status, code, names):
    before = live.num_events()
    path = "/score" if "candidate_video_ids" in doc else "/events"
    for url in (live.router.url, live.nodes[0].url):
        got, answer = post(url, path, doc)
        assert (got, answer["error"]["code"]) == (status, code), answer
        assert names in answer["error"]["message"]
    assert live.num_events() == before


def test_a_user_never_seen_is_served_from_inline_events(live):
    user, t = 2 * 10**7, live.split + 5000
    status, answer = post(live.router.url, "/score", {
        "user_id": user, "request_time_ms": t + 100, "candidate_video_ids": [3, 4],
        "events": [{"video_id": 7, "time_ms": t}, {"video_id": 8, "time_ms": t + 1, "is_click": 1}]})
    assert status == 200, answer
    assert answer["history_length"] == 2 and answer["cache"]["tokens_reused"] == 0
    status, answer = post(live.router.url, "/score", {"user_id": user + 1, "request_time_ms": t, "candidate_video_ids": [3]})
    assert (status, answer["error"]["code"]) == (422, "no_history")
    metrics = urllib.request.urlopen(f"{live.nodes[0].url}/metrics", timeout=TIMEOUT_S).read().decode()
    assert 'hstu_history_events_total{outcome="appended"}' in metrics


def test_a_refused_visit_says_what_its_inline_events_stored(live):
    user, t = 5 * 10**7, live.split + 7000
    events = [{"video_id": 9, "time_ms": t + 50}, {"video_id": 10, "time_ms": t + 60, "is_click": 1}]
    early = {"user_id": user, "request_time_ms": t, "candidate_video_ids": [3], "events": events}
    stored = [{"appended": 2, "duplicates": 0, "late": 0, "replayed": False},
              {"appended": 0, "duplicates": 2, "late": 0, "replayed": False}]  # the retry: exact copies
    for url, expected in zip((live.router.url, live.nodes[0].url), stored):
        status, answer = post(url, "/score", early)
        assert (status, answer["error"]["code"]) == (422, "no_history"), answer
        assert answer["events_stored"] == expected
    status, answer = post(live.router.url, "/score", {**early, "request_time_ms": t + 100})
    assert status == 200 and answer["history_length"] == 2 and answer["events_stored"]["duplicates"] == 2
    status, answer = post(live.router.url, "/score", {k: v for k, v in early.items() if k != "events"})
    assert status == 422 and "events_stored" not in answer  # no inline events: nothing to say


def test_router_and_node_agree_on_an_empty_batch(live):
    event = {"user_id": 6 * 10**7, "video_id": 1, "time_ms": live.split + 9000}
    assert post(live.router.url, "/events", {"events": [event], "batch_id": "used"})[0] == 200
    for url in (live.router.url, live.nodes[0].url, live.nodes[1].url):
        status, answer = post(url, "/events", {"events": [], "batch_id": "used"})
        assert (status, answer["error"]["code"]) == (409, "batch_conflict"), url
        assert post(url, "/events", {"events": []}) == (200, {"appended": 0, "duplicates": 0, "late": 0,
                                                                 "replayed": False})
    assert post(live.router.url, "/events", {"events": [], "batch_id": "empty"})[1]["replayed"] is False
    assert post(live.nodes[1].url, "/events", {"events": [], "batch_id": "empty"})[1]["replayed"] is True


def test_slow_bodies_to_a_node_are_all_closed_at_its_deadline_and_its_fds_return(live):
    node = live.nodes[1]
    fds = Path(f"/proc/{node.proc.pid}/fd")
    idle = len(list(fds.iterdir()))
    head = f"POST /events HTTP/1.1\r\nHost: {node.address}\r\nContent-Length: 1000\r\n\r\n".encode()

    async def slow_bodies(count: int) -> tuple[list[bytes], float]:
        opened = [await asyncio.open_connection(*node.address.rsplit(":", 1)) for _ in range(count)]
        for _, writer in opened:
            writer.write(head + b'{"events": [')  # a tenth of the body, then silence
        started = time.monotonic()
        answers = await asyncio.gather(*(asyncio.wait_for(reader.read(), 10 * BODY_TIMEOUT_S) for reader, _ in opened))
        elapsed = time.monotonic() - started
        for _, writer in opened:
            writer.close()
        return answers, elapsed

    answers, elapsed = asyncio.run(slow_bodies(200))
    assert all(a.startswith(b"HTTP/1.1 408") and b"request_timeout" in a for a in answers)
    assert elapsed < 10 * BODY_TIMEOUT_S  # each read above is bounded by that too: none hung
    deadline = time.monotonic() + 10 * BODY_TIMEOUT_S
    while len(list(fds.iterdir())) > idle and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list(fds.iterdir())) <= idle


def test_a_node_killed_while_ingesting_loses_no_acknowledged_event(live, tmp_path):
    victim, survivor = live.nodes
    user, t0 = 3 * 10**7, live.split + 10_000
    acked: list[int] = []
    stop = threading.Event()

    def ingest() -> None:
        for i in range(10_000):
            if stop.is_set():
                return
            try:
                status, _ = post(victim.url, "/events", {"events": [{"user_id": user, "video_id": i, "time_ms": t0 + i}]})
            except OSError:
                return
            if status != 200:
                return
            acked.append(i)

    thread = threading.Thread(target=ingest)
    thread.start()
    while len(acked) < 30:
        thread.join(0.01)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(TIMEOUT_S)
    stop.set()
    thread.join(TIMEOUT_S)
    status, answer = post(survivor.url, "/score", {"user_id": user, "request_time_ms": t0 + 20_000, "candidate_video_ids": [1]})
    assert status == 200, answer
    assert answer["history_length"] >= len(acked)  # every acknowledged event (and maybe the one in flight)
    with SQLiteHistoryStore(live.store_path) as store:
        stored = store.read(np.array([user]), np.array([t0 + 20_000]))
    assert set(acked) <= set(stored.video_ids.tolist())


def test_a_node_over_the_shared_store_answers_503_while_it_is_down_and_recovers(serving_artifacts, make_redis_server,
                                                                                  tmp_path):
    from history.redis_store import RedisHistoryStore

    data_dir, checkpoint = serving_artifacts
    redis = make_redis_server(durable=True)
    url = redis.url
    with RedisHistoryStore.from_url(url) as store:
        bootstrap_from_output(store, data_dir, progress=False)
    node = start_node(None, checkpoint, tmp_path / "logs", extra_args=NODE_ARGS, history_store=url)
    try:
        wait_healthy([node], timeout_s=240)
        user, t = 4 * 10**7, 1_700_000_000_000
        event = {"user_id": user, "video_id": 1, "time_ms": t}
        assert post(node.url, "/events", {"events": [event]})[0] == 200
        redis.kill()
        status, answer = post(node.url, "/events", {"events": [{**event, "video_id": 2}]})
        assert (status, answer["error"]["code"]) == (503, "history_unavailable")
        status, answer = post(node.url, "/score", {"user_id": user, "request_time_ms": t + 10, "candidate_video_ids": [1]})
        assert (status, answer["error"]["code"]) == (503, "history_unavailable")
        redis.restart()
        status, answer = post(node.url, "/score", {"user_id": user, "request_time_ms": t + 10, "candidate_video_ids": [1],
                                                   "events": [{"video_id": 3, "time_ms": t + 5}]})
        assert status == 200, answer
        assert answer["history_length"] == 2  # the acknowledged event survived; the refused one was never stored
    finally:
        node.stop(timeout_s=30)
