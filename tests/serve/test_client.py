"""The retrying client against fake routers: what it retries, what it does not, and the request id it keeps."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmark.harness.launch import free_port
from serve.client import RoutersUnavailableError, ScoreClient
from serve.protocol import RequestError

REQUEST = {"user_id": 7, "request_time_ms": 1_650_000_000_000, "candidate_video_ids": [1, 2]}


class FakeRouter:
    """Answers POST /score with `status` and `answer` (an `{request_id}` in it is filled in); records bodies."""

    def __init__(self, status: int, answer: dict) -> None:
        self.bodies: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.bodies.append(body)
                payload = json.dumps(answer).replace("{request_id}", body.get("request_id", "")).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_routers():
    started: list[FakeRouter] = []

    def make(*specs: tuple[int, dict]) -> list[FakeRouter]:
        started.extend(FakeRouter(*spec) for spec in specs)
        return started

    yield make
    for router in started:
        router.close()


SCORED = (200, {"request_id": "{request_id}", "logits": [[0.5]]})
NO_NODE = (503, {"error": {"code": "no_node_available", "message": "no node is up"}})


def test_a_503_is_retried_on_the_next_router_with_the_same_request_id(fake_routers):
    busy, good = fake_routers(NO_NODE, SCORED)
    answer = ScoreClient([busy.url, good.url]).score(REQUEST)
    assert answer.router == good.url and answer.attempts == 2 and answer.body["logits"] == [[0.5]]
    request_id = answer.body["request_id"]
    assert request_id and [b["request_id"] for b in busy.bodies + good.bodies] == [request_id, request_id]
    assert good.bodies[0] == {**REQUEST, "request_id": request_id}


def test_a_dead_router_is_skipped_and_the_callers_request_id_is_kept(fake_routers):
    (good,) = fake_routers(SCORED)
    answer = ScoreClient([f"127.0.0.1:{free_port()}", good.url]).score({**REQUEST, "request_id": "r-9"})
    assert answer.body["request_id"] == "r-9" and answer.attempts == 2


def test_a_refusal_is_not_retried(fake_routers):
    bad, other = fake_routers((400, {"error": {"code": "invalid_field", "message": "user_id must be an integer"}}),
                              SCORED)
    with pytest.raises(RequestError) as caught:
        ScoreClient([bad.url, other.url]).score(REQUEST)
    assert (caught.value.status, caught.value.code) == (400, "invalid_field") and other.bodies == []


def test_no_router_answering_ends_at_the_deadline_with_the_last_error():
    client = ScoreClient([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], deadline_s=0.5, backoff_s=0.05)
    started = time.monotonic()
    with pytest.raises(RoutersUnavailableError, match=r"no router answered in 0.5 s \(\d+ attempts; last: .*Connection"):
        client.score(REQUEST)
    assert 0.5 <= time.monotonic() - started < 3.0


def test_an_answer_to_another_request_is_an_error(fake_routers):
    (wrong,) = fake_routers((200, {"request_id": "someone-else", "logits": []}))
    with pytest.raises(RuntimeError, match="answered request 'someone-else' to request 'r-1'"):
        ScoreClient([wrong.url]).score({**REQUEST, "request_id": "r-1"})


def test_router_urls_are_checked():
    with pytest.raises(ValueError, match="at least one router"):
        ScoreClient([])
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        ScoreClient(["https://router:8000"])


def test_an_unknown_outcome_is_retried_with_the_same_batch_id(fake_routers):
    unknown = (503, {"error": {"code": "outcome_unknown", "message": "no answer to the append: it may have been stored"}})
    stalled, good = fake_routers(unknown, (200, {"appended": 0, "duplicates": 0, "late": 0, "replayed": True}))
    answer = ScoreClient([stalled.url, good.url]).events([{"user_id": 7, "video_id": 1, "time_ms": 1_650_000_000_000}])
    assert answer.body["replayed"] is True and answer.attempts == 2
    batch_ids = [b["batch_id"] for b in stalled.bodies + good.bodies]
    assert batch_ids[0] and batch_ids == [batch_ids[0]] * 2
