"""The HTTP API's values: a score request parsed and checked, the answer, and the errors.

A request (POST /score, JSON):

    {"user_id": 42, "request_time_ms": 1650000000000, "candidate_video_ids": [17, 5, 99],
     "request_id": "optional, echoed back",
     "events": [{"video_id": 3, "time_ms": 1649999990000, "is_click": 1}]}   # optional, see below

`events` (optional) are the visit's new events, in POST /events' format (serve/ingest.py; user_id
may be left out): the node stores them durably first, then scores the visit.

Everything that can be checked without the dataset is checked here, by the router and the node
alike, so that a malformed request never reaches a node's cache. A refusal is a `RequestError`:
an HTTP status, a stable machine-readable code and a message naming the field and the value.
The dataset-dependent checks (unknown user, no history before the request time) are the node's
(serve/engine.py).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from data.schema import TASKS, TIME_MS_RANGE, TIME_MS_RANGE_TEXT
from history.events import EventBatch, EventError

if TYPE_CHECKING:  # model/ imports torch, which the router never loads
    from model.visit import VisitCache

MAX_ID = 2**63 - 1  # ids and times are int64 on the node
FIELDS = ("user_id", "request_time_ms", "candidate_video_ids", "request_id", "events")
REQUIRED = ("user_id", "request_time_ms", "candidate_video_ids")
MAX_REQUEST_ID_CHARS = 200
EVENTS_FIELDS = ("events", "batch_id")
DEFAULT_MAX_EVENTS = 10_000
DEFAULT_MAX_FUTURE_MS = 60_000  # clock skew a client may have: events further ahead are refused


class RequestError(Exception):
    """A request refused before it reached the cache: `status` 4xx (or 503), `code`, `message`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def to_json(self) -> dict:
        return {"error": {"code": self.code, "message": self.message}}


def bad_request(code: str, message: str) -> RequestError:
    return RequestError(400, code, message)


def unprocessable(code: str, message: str) -> RequestError:
    return RequestError(422, code, message)


@dataclass(frozen=True)
class ScoreQuery:
    """One checked score request."""

    user_id: int
    request_time_ms: int
    candidate_video_ids: tuple[int, ...]
    request_id: str | None = None
    events: EventBatch | None = None  # new events to store before scoring


def parse_score_request(body: bytes, max_candidates: int | None = None, max_time_ms: int | None = None,
                        max_events: int | None = None) -> ScoreQuery:
    """The request in `body`, or a `RequestError` (400: malformed; 413: too many events; 422: too many
    candidates). Inline events after `max_time_ms` are refused (the node's clock; None: not checked)."""
    try:
        doc = json.loads(body)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, and an integer over Python's 4300 digits
        raise bad_request("malformed_json", f"the request body is not valid JSON: {str(err)[:200]}") from None
    except RecursionError:
        raise bad_request("malformed_json", "the request body nests JSON too deeply") from None
    if not isinstance(doc, dict):
        raise bad_request("malformed_request", f"the request body must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(FIELDS))
    if unknown:
        raise bad_request("unknown_field", f"unknown field(s) {unknown}; a request has {list(FIELDS)}")
    missing = [f for f in REQUIRED if f not in doc]
    if missing:
        raise bad_request("missing_field", f"missing field(s) {missing}")
    user_id = _non_negative_int(doc["user_id"], "user_id")
    request_time_ms = _time_ms(doc["request_time_ms"], "request_time_ms")
    candidates = doc["candidate_video_ids"]
    if not isinstance(candidates, list):
        raise bad_request("invalid_field", f"candidate_video_ids must be a list of video ids, got {_show(candidates)}")
    if not candidates:
        raise bad_request("invalid_field", f"user {user_id}: candidate_video_ids is empty")
    if max_candidates is not None and len(candidates) > max_candidates:
        raise unprocessable(
            "too_many_candidates",
            f"user {user_id}: {len(candidates)} candidate_video_ids, at most {max_candidates} per request",
        )
    if not (all(type(v) is int for v in candidates) and min(candidates) >= 0 and max(candidates) <= MAX_ID):
        for i, video in enumerate(candidates):  # name the first bad one (bool is not an id: type(True) is bool)
            _non_negative_int(video, f"candidate_video_ids[{i}]")
    request_id = _optional_text(doc.get("request_id"), "request_id", min_chars=0)
    events = None
    if "events" in doc:
        records = doc["events"]
        if max_events is not None and isinstance(records, list) and len(records) > max_events:
            raise RequestError(413, "too_many_events", f"user {user_id}: {len(records)} events, at most {max_events}")
        events = parse_event_records(records, max_time_ms=max_time_ms, default_user_id=user_id)
        other = events.user_id != user_id
        if other.any():
            i = int(other.argmax())
            raise bad_request("invalid_event",
                              f"events[{i}].user_id is {int(events.user_id[i])}, the request's user is {user_id}")
    return ScoreQuery(user_id, request_time_ms, tuple(candidates), request_id, events)


def parse_event_records(records: object, where: str = "events", max_time_ms: int | None = None,
                        default_user_id: int | None = None) -> EventBatch:
    """JSON event records -> EventBatch, or a 400 RequestError naming `where[i].field`.
    `default_user_id` fills a record without a user_id (a score request's inline events)."""
    if not isinstance(records, list):
        raise bad_request("invalid_field", f"{where} must be a list of event objects")
    if default_user_id is not None:
        records = [{"user_id": default_user_id, **r} if isinstance(r, dict) and "user_id" not in r else r
                   for r in records]
    try:
        return EventBatch.from_records(records, max_time_ms=max_time_ms)
    except EventError as err:
        raise bad_request("invalid_event", f"{where}: {err}") from None


def parse_events_request(body: bytes, max_events: int = DEFAULT_MAX_EVENTS, max_time_ms: int | None = None
                         ) -> tuple[EventBatch, str | None]:
    """The events and batch_id of a POST /events body, or a RequestError."""
    try:
        doc = json.loads(body)
    except ValueError as err:
        raise bad_request("malformed_json", f"the request body is not valid JSON: {str(err)[:200]}") from None
    except RecursionError:
        raise bad_request("malformed_json", "the request body nests JSON too deeply") from None
    if not isinstance(doc, dict):
        raise bad_request("malformed_request", f"the request body must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(EVENTS_FIELDS))
    if unknown:
        raise bad_request("unknown_field", f"unknown field(s) {unknown}; an events request has {list(EVENTS_FIELDS)}")
    if "events" not in doc:
        raise bad_request("missing_field", "missing field(s) ['events']")
    records = doc["events"]
    if isinstance(records, list) and len(records) > max_events:
        raise RequestError(413, "too_many_events", f"{len(records)} events in one request, at most {max_events}")
    batch_id = _optional_text(doc.get("batch_id"), "batch_id", min_chars=1)
    return parse_event_records(records, max_time_ms=max_time_ms), batch_id


def _non_negative_int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ID:
        raise bad_request("invalid_field", f"{field} must be an integer in [0, 2**63), got {_show(value)}")
    return value


def _optional_text(value: object, field: str, min_chars: int) -> str | None:
    """An id string (request_id, batch_id): at most MAX_REQUEST_ID_CHARS, valid Unicode (JSON's escapes
    can spell a lone surrogate, which no UTF-8 store or log takes)."""
    if value is None:
        return None
    if not isinstance(value, str) or not min_chars <= len(value) <= MAX_REQUEST_ID_CHARS:
        size = "a non-empty string" if min_chars else "a string"
        raise bad_request("invalid_field", f"{field} must be {size} of at most {MAX_REQUEST_ID_CHARS} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad_request("invalid_field", f"{field} holds a lone surrogate at character {err.start}: "
                                           "it must be valid Unicode") from None
    return value


def _time_ms(value: object, field: str) -> int:
    """A request time: in the range events may have (history/events.py), which also keeps it inside
    the 42 bits a token stamp holds (model/attention/token_stamp.py)."""
    low, high = TIME_MS_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request("invalid_field", f"{field} must be epoch milliseconds in [{low}, {high}] "
                                           f"({TIME_MS_RANGE_TEXT}), got {_show(value)}")
    return value


def _show(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class ScoredVisit:
    """A node's answer to one `ScoreQuery`."""

    query: ScoreQuery
    node_id: str
    logits: list[list[float]]  # [candidates][tasks]
    history_length: int  # events before request_time_ms
    cache: VisitCache
    batch_size: int
    queue_ms: float
    compute_ms: float

    def to_json(self) -> dict:
        return {
            "user_id": self.query.user_id,
            "request_id": self.query.request_id,
            "node": self.node_id,
            "tasks": list(TASKS),
            "logits": self.logits,
            "history_length": self.history_length,
            "cache": {
                "tier": self.cache.tier,
                "tokens_reused": self.cache.tokens_reused,
                "tokens_computed": self.cache.tokens_computed,
                "tokens_recomputed": self.cache.tokens_recomputed,
                "shared_reload_bytes": self.cache.shared_reload_bytes,
            },
            "batch_size": self.batch_size,
            "queue_ms": round(self.queue_ms, 3),
            "compute_ms": round(self.compute_ms, 3),
        }
