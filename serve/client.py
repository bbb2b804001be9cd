"""A client of several routers that retries a request on another one: the client side of the retry contract.

    client = ScoreClient(["http://router-a:8000", "http://router-b:8000"])
    answer = client.score({"user_id": 52, "request_time_ms": 1650598436000, "candidate_video_ids": [3120, 771]})
    answer.body["logits"], answer.router, answer.attempts

The contract (docs/serving.md, "Deploying to a cluster"):

* Every request carries a `request_id`; the client makes one up when the caller gave none, and
  every attempt of the request carries the same one. The answer echoes it (checked here), and the
  routers' and nodes' logs can follow one request across its attempts.
* Scoring a visit is idempotent: the same (user, time, candidates) gets the same logits on any
  node, and a second run leaves the same K/V cached. So a request whose router died before
  answering is sent again, to the next router, although a node may already have scored it.
* Retried: a connection that fails, times out or closes before the answer, and 503 (no node
  available, every node overloaded, a router shutting down, an append whose outcome the store does
  not know: `outcome_unknown`, retried with the same batch_id, whose answer then says what was
  stored). Not retried: 4xx (the request is wrong, and stays wrong) and other answers. Attempts
  cycle through the routers, with a backoff after each full round, until `deadline_s`; then
  `RoutersUnavailableError`.
"""
from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from serve.protocol import RequestError


class RoutersUnavailableError(RuntimeError):
    """No router answered the request within the client's deadline."""


@dataclass(frozen=True)
class ClientAnswer:
    body: dict  # the node's answer (serve.protocol.ScoredVisit.to_json)
    router: str  # the router that answered
    attempts: int  # 1 when the first router answered


class ScoreClient:
    """Thread-safe: each call opens its own connection, and only the starting router is shared state."""

    def __init__(self, routers: Sequence[str], timeout_s: float = 30.0, deadline_s: float = 60.0,
                 backoff_s: float = 0.05, max_backoff_s: float = 1.0, token: str | None = None) -> None:
        """`token`: the bearer token the routers know this client by (serve/auth.py), if they check."""
        if not routers:
            raise ValueError("ScoreClient needs at least one router URL")
        self.routers = [_host_port(url) for url in routers]
        self.urls = list(routers)
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._next_start = itertools.count()  # spreads requests over the routers
        self._lock = threading.Lock()

    def score(self, request: dict) -> ClientAnswer:
        """POST /score through any router; RequestError for a refusal (4xx), RoutersUnavailableError after the deadline."""
        request = dict(request)
        request.setdefault("request_id", uuid.uuid4().hex)
        return self._send("/score", request, request["request_id"])

    def events(self, events: list[dict], batch_id: str | None = None) -> ClientAnswer:
        """POST /events through any router, retried like `score`: every attempt carries the same batch_id
        (made up when None), so a batch that was stored before its answer was lost is not stored twice."""
        return self._send("/events", {"events": events, "batch_id": batch_id or uuid.uuid4().hex}, None)

    def _send(self, path: str, request: dict, request_id: str | None) -> ClientAnswer:
        body = json.dumps(request, separators=(",", ":")).encode()
        with self._lock:
            start = next(self._next_start)
        deadline = time.monotonic() + self.deadline_s
        backoff = self.backoff_s
        failures: list[str] = []
        attempt = 0
        while True:
            attempt += 1
            index = (start + attempt - 1) % len(self.routers)
            try:
                status, answer = self._post(self.routers[index], path, body)
            except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, closed early
                failures.append(f"{self.urls[index]}: {type(err).__name__}: {err}")
            else:
                if status == 200:
                    if request_id is not None and answer.get("request_id") != request_id:
                        raise RuntimeError(f"{self.urls[index]} answered request {answer.get('request_id')!r} "
                                           f"to request {request_id!r}")
                    return ClientAnswer(answer, self.urls[index], attempt)
                error = answer.get("error") if isinstance(answer.get("error"), dict) else {}
                if status != 503:
                    raise RequestError(status, str(error.get("code", "")), str(error.get("message", answer)))
                failures.append(f"{self.urls[index]}: 503 {error.get('code')}")
            if time.monotonic() >= deadline:
                raise RoutersUnavailableError(
                    f"{path} request {request_id or request['batch_id']}: no router answered in {self.deadline_s:g} s "
                    f"({attempt} attempts; last: {failures[-1]})")
            if attempt % len(self.routers) == 0:  # every router failed this round: back off before the next
                time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, self.max_backoff_s)

    def _post(self, host_port: tuple[str, int], path: str, body: bytes) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(*host_port, timeout=self.timeout_s)
        try:
            conn.request("POST", path, body, self._headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):  # not the API's answer (a proxy's error page): show its start
            answer = {"error": {"code": "", "message": raw[:200].decode(errors="replace")}}
        return response.status, answer


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "//" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"a router URL is http://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port or 80
