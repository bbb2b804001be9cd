"""POST /events: a batch of logged events, parsed, checked and appended durably to the history store.

    {"events": [{"user_id": 7, "video_id": 1234, "time_ms": 1650000000000, "is_click": 1}, ...],
     "batch_id": "optional client id: a retried batch is applied once"}
    -> 200 {"appended": 2, "duplicates": 0, "late": 0, "replayed": false}

The answer comes only after the store made the events durable (history/base.py). Retrying after a
timeout is always safe: an exact copy of a stored event stores nothing, and a `batch_id` seen before
answers its first result again. Refusals name the event and the field (400 invalid_event), a batch
over the limit is 413 too_many_events, a batch_id reused for other events 409 batch_conflict, a store
that cannot be reached 503 history_unavailable; nothing is stored in any of these cases. A store that
took the append and did not answer (a timeout) is 503 outcome_unknown: the batch may be stored, and a
retry with the same batch_id answers what was (an exact copy of a stored event stores nothing again).
Appends run on their own threads, never on the node's compute thread, so ingestion does not queue
behind scoring (nor scoring behind a slow disk).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from history.base import AppendOutcomeUnknownError, AppendResult, BatchConflictError, HistoryStore, HistoryUnavailableError
from history.events import EventBatch
from serve.metrics import LATENCY_BUCKETS_S, Registry
from serve.protocol import DEFAULT_MAX_FUTURE_MS, RequestError


class IngestMetrics:
    def __init__(self, registry: Registry) -> None:
        self.events = registry.counter(
            "hstu_history_events_total", "Events received, by outcome (appended, duplicate; late is a subset of "
            "appended: older than their user's latest stored event).", ("outcome",))
        self.appends = registry.counter("hstu_history_appends_total", "Appends to the history store, by result.",
                                        ("result",))
        self.seconds = registry.histogram("hstu_history_append_seconds", "Time to append durably.", LATENCY_BUCKETS_S)
        for outcome in ("appended", "duplicate", "late"):
            self.events.inc(0, outcome=outcome)
        for result in ("ok", "replayed", "conflict", "unavailable", "outcome_unknown"):
            self.appends.inc(0, result=result)


class Ingestor:
    """Appends on a small thread pool; one `append` call per request (all or nothing)."""

    def __init__(self, store: HistoryStore, registry: Registry, threads: int = 2,
                 max_future_ms: int = DEFAULT_MAX_FUTURE_MS) -> None:
        self.store = store
        self.max_future_ms = max_future_ms
        self.metrics = IngestMetrics(registry)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ingest")

    def max_time_ms(self) -> int:
        """The latest event time accepted now."""
        return int(time.time() * 1000) + self.max_future_ms

    async def append(self, events: EventBatch, batch_id: str | None = None) -> AppendResult:
        started = time.perf_counter()
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, self.store.append, events, batch_id)
        except BatchConflictError as err:
            self.metrics.appends.inc(result="conflict")
            raise RequestError(409, "batch_conflict", str(err)) from None
        except AppendOutcomeUnknownError as err:  # before its base class: this one may have stored the batch
            self.metrics.appends.inc(result="outcome_unknown")
            raise RequestError(503, "outcome_unknown", str(err)) from None
        except HistoryUnavailableError as err:
            self.metrics.appends.inc(result="unavailable")
            raise RequestError(503, "history_unavailable", str(err)) from None
        self.metrics.seconds.observe(time.perf_counter() - started)
        self.metrics.appends.inc(result="replayed" if result.replayed else "ok")
        if not result.replayed:
            self.metrics.events.inc(result.appended, outcome="appended")
            self.metrics.events.inc(result.duplicates, outcome="duplicate")
            self.metrics.events.inc(result.late, outcome="late")
        return result

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def append_result_json(result: AppendResult) -> dict:
    return {"appended": result.appended, "duplicates": result.duplicates, "late": result.late,
            "replayed": result.replayed}


def with_events_stored(doc: dict, stored: AppendResult | None) -> dict:
    """A /score answer (scores or a refusal) that says what its inline events stored, when it stored any."""
    return doc if stored is None else {**doc, "events_stored": append_result_json(stored)}
