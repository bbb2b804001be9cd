"""FailOpenStorage: a tier that is down, slow or returns bad data costs recomputation, never a visit.

A persistent or shared tier is an optimisation: whatever goes wrong with it, the visit can be
served by recomputing the user's history. The wrapper turns every failure of the tier it wraps
into what the caller already handles: `info`/`read` -> None (a miss), `write` -> not stored,
`drop` -> False. It also

* bounds the calls that move pages (`read`, `write`, `drop`) by `timeout_s`: they run on one
  worker thread and are abandoned past it (`info` and the gauges run inline: an index lookup or
  one round trip the tier bounds with its own socket timeout);
* stops calling a failing tier for a while (`retry_after_s`, doubling per consecutive failure up
  to `max_retry_after_s`), so that a dead server costs one timeout per retry period, not one per
  call; a call abandoned on the worker also keeps the tier skipped until it returns;
* validates what the tier returns (entry fields, pages' shape and dtype against the layout):
  bad data, like a `TierDataError` raised by the tier, counts as a corrupt read and drops the entry;
* hides a user from the tier after a bad read or a failed drop, until a later write or drop of
  that user succeeds, so that an entry that was invalidated or found bad never comes back.

Counters (`counters()`): `failures` (calls that raised), `timeouts` (calls abandoned),
`corrupt_reads`, `skipped` (calls not made while the tier was failing). A warning goes to the
"kvcache" logger once per failure streak. While a tier fails, its entries may fall behind (writes
and drops are lost): the tag stored with each entry is what keeps a stale one from being reused.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import TypeVar

import torch
from torch import Tensor

from ..page_data import EncodedPageData, PageData, empty_pages
from ..page_layout import PageLayout
from .base import HostEntry, HostKVStorage, HostPages, HostWriteResult, PageFill, TierDataError, sum_counters

log = logging.getLogger("kvcache")
T = TypeVar("T")
_NOT_STORED = HostWriteResult(False, ())


class FailOpenStorage(HostKVStorage):
    """Wraps `inner` so that it never raises into the cache (see the module docstring).

    `name` identifies the tier in logs. `timeout_s=None` runs every call inline and relies on the
    tier's own timeouts (e.g. a socket timeout); exceptions are still caught.
    """

    def __init__(
        self, inner: HostKVStorage, name: str, timeout_s: float | None = None,
        retry_after_s: float = 1.0, max_retry_after_s: float = 30.0,
    ) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}.")
        if not 0 <= retry_after_s <= max_retry_after_s:
            raise ValueError(f"need 0 <= retry_after_s <= max_retry_after_s, got {retry_after_s}, {max_retry_after_s}.")
        self.inner = inner
        self.shared = inner.shared
        self.name = name
        self.timeout_s = timeout_s
        self._retry_after = (retry_after_s, max_retry_after_s)
        self._worker = _CallThread(f"kvcache-{name}", timeout_s) if timeout_s is not None else None
        if self._worker is not None:
            weakref.finalize(self, self._worker.close)  # also at exit, before the interpreter finalises
        self._abandoned: Future | None = None  # a timed-out call still running on the worker
        self._retry_at = 0.0
        self._backoff = 0.0
        self._failing = False
        self._warned_bad_data = False
        self._hidden: set[int] = set()
        self.failures = self.timeouts = self.corrupt_reads = self.skipped = 0

    def bind(self, layout: PageLayout) -> None:
        """Binds the inner tier too; a layout it refuses is a configuration error and raises."""
        super().bind(layout)
        self.inner.bind(layout)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
        try:
            self.inner.close()
        except Exception as exc:  # closing is best effort
            log.debug("kvcache tier %r: close failed: %r", self.name, exc)

    def counters(self) -> dict[str, int]:
        own = {"failures": self.failures, "timeouts": self.timeouts, "corrupt_reads": self.corrupt_reads,
               "skipped": self.skipped}
        try:
            inner = self.inner.counters()  # local state: no I/O, no failure streak to track
        except Exception:
            inner = {}
        return sum_counters(own, inner)

    # ------------------------------------------------------------------ gauges (0 while failing)
    @property
    def capacity_bytes(self) -> int:
        return self._call("capacity_bytes", lambda: self.inner.capacity_bytes, 0, inline=True)

    @property
    def bytes_used(self) -> int:
        return self._call("bytes_used", lambda: self.inner.bytes_used, 0, inline=True)

    @property
    def num_users(self) -> int:
        return self._call("num_users", lambda: self.inner.num_users, 0, inline=True)

    # ------------------------------------------------------------------ the contract
    def info(self, user_id: int) -> HostEntry | None:
        if user_id in self._hidden:
            return None
        h = self._call("info", lambda: self.inner.info(user_id), None, inline=True)
        if h is not None and not _valid_entry(h):
            self._bad_data(user_id, f"info returned {h!r:.200}")
            return None
        return h

    def read(self, user_id: int) -> HostPages | None:
        if user_id in self._hidden:
            return None
        hp = self._call("read", lambda: self.inner.read(user_id), None)
        if hp is not None:
            problem = self._check_pages(hp)
            if problem:
                self._bad_data(user_id, problem)
                return None
        return hp

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        fill_errors: list[BaseException] = []
        if self._worker is None:
            def tier_fill(dst: PageData) -> None:
                try:
                    fill(dst)
                except BaseException as exc:  # the caller's failure, not the tier's: re-raised below
                    fill_errors.append(exc)
                    raise
        else:
            # The tier may run this after we gave up on it: hand it a private copy, never the
            # caller's `fill` (whose source pages may be reused by then).
            if not self._available():
                self.skipped += 1
                return _NOT_STORED
            pages = max(self.layout.num_pages(length) - first_page, 0)  # a bad range: the tier refuses it
            staged = empty_pages(self.layout, pages)
            fill(staged)

            def tier_fill(dst: PageData) -> None:
                dst.copy_(staged)
        result = self._call(
            "write", lambda: self.inner.write(user_id, start_pos, length, first_page, tier_fill, protect, tag),
            _NOT_STORED, fill_errors=fill_errors,
        )
        if not isinstance(result, HostWriteResult):
            self._bad_data(user_id, f"write returned {result!r:.200}")
            return _NOT_STORED
        if result.stored:
            self._hidden.discard(user_id)
        return result

    def drop(self, user_id: int) -> bool:
        dropped = self._call("drop", lambda: self.inner.drop(user_id), None)
        if dropped is None:  # the tier may still hold it: never report it again from here
            self._hidden.add(user_id)
            return False
        self._hidden.discard(user_id)
        return bool(dropped)

    # ------------------------------------------------------------------ internals
    def _available(self) -> bool:
        if self._abandoned is not None:
            if not self._abandoned.done():
                return False
            self._abandoned = None
        return time.monotonic() >= self._retry_at

    def _call(
        self, what: str, fn: Callable[[], T], default: T, inline: bool = False,
        fill_errors: Sequence[BaseException] = (),
    ) -> T:
        """fn() with failures turned into `default` (see the module docstring)."""
        if not self._available():
            self.skipped += 1
            return default
        try:
            if inline or self._worker is None:
                result = fn()
            else:
                future = self._worker.submit(fn)
                try:
                    result = future.result(self.timeout_s)
                except TimeoutError:
                    if future.done():
                        raise  # the tier's own timeout
                    self._abandoned = future
                    self.timeouts += 1
                    self._trip(what, f"no answer within {self.timeout_s}s")
                    return default
        except Exception as exc:
            if any(exc is e for e in fill_errors):
                raise
            if isinstance(exc, TierDataError):
                self.corrupt_reads += 1
                self._warn_bad_data(f"{what}: {exc}")
                return default
            if isinstance(exc, TimeoutError):
                self.timeouts += 1
            else:
                self.failures += 1
            self._trip(what, repr(exc))
            return default
        if self._failing:
            log.warning("kvcache tier %r answers again.", self.name)
            self._failing = False
        self._backoff = 0.0
        return result

    def _trip(self, what: str, reason: str) -> None:
        """A failure: skip the tier for the back-off period; warn at the start of a streak."""
        first, most = self._retry_after
        self._backoff = min(most, self._backoff * 2) if self._backoff else first
        self._retry_at = time.monotonic() + self._backoff
        if not self._failing:
            self._failing = True
            log.warning(
                "kvcache tier %r failed (%s: %s); serving without it (misses are recomputed, writes not "
                "stored) and retrying after %.3gs.", self.name, what, reason, self._backoff,
            )

    def _bad_data(self, user_id: int, problem: str) -> None:
        self.corrupt_reads += 1
        self._warn_bad_data(f"user {user_id}: {problem}")
        self.drop(user_id)  # hides the user if the drop does not succeed

    def _warn_bad_data(self, problem: str) -> None:
        if not self._warned_bad_data:
            self._warned_bad_data = True
            log.warning("kvcache tier %r returned bad data (%s); the entry is dropped and recomputed "
                        "(later ones are counted in corrupt_reads).", self.name, problem)

    def _check_pages(self, hp: HostPages) -> str | None:
        """Why `hp` cannot be onloaded, or None."""
        if not isinstance(hp, HostPages) or not _valid_entry(hp.entry):
            return f"read returned {hp!r:.200}"
        pages, layout = hp.pages, self.layout
        n = layout.num_pages(hp.length)
        if isinstance(pages, EncodedPageData):
            return None if pages.num_pages == n else f"read returned {pages.num_pages} encoded pages for {hp.length} tokens"
        if not isinstance(pages, PageData) or not all(isinstance(t, Tensor) for t in (pages.kv, pages.times)):
            return f"read returned pages of type {type(pages).__name__} for {hp.length} tokens"
        expected = {"kv": ((n, *layout.page_shape), layout.dtype), "times": ((n, layout.page_size), torch.int64)}
        for name, (shape, dtype) in expected.items():
            got = getattr(pages, name)
            if tuple(got.shape) != shape or got.dtype != dtype:
                return (f"read returned page {name} {tuple(got.shape)} {got.dtype} for {hp.length} tokens, "
                        f"expected {shape} {dtype}")
        return None


def _valid_entry(h: HostEntry) -> bool:
    return (
        isinstance(h, HostEntry) and type(h.start_pos) is int and type(h.length) is int
        and h.start_pos >= 0 and h.length > 0 and isinstance(h.tag, bytes)
    )


class _CallThread:
    """One daemon thread running calls in submission order: the wrapped tier sees one caller at a
    time, and a call that hangs forever never blocks the interpreter's exit.

    The thread must not be running when the interpreter finalises: a daemon thread that needs
    the GIL back then is ended by `pthread_exit`, and if it is inside torch (any op that
    releases the GIL, even freeing a tensor) the unwind crosses a `noexcept` C++ frame and the
    process aborts ("terminate called without an active exception"). So `close` (also run at
    exit) joins it, and between calls it holds no reference to a call, its result or its error:
    whatever a call returned is freed by the caller's thread. Only a call hung past `join_s`
    is left behind.
    """

    def __init__(self, name: str, join_s: float) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._join_s = join_s
        self._thread = threading.Thread(target=_run_calls, args=(self._queue,), name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], T]) -> Future:
        future: Future = Future()
        self._queue.put((future, fn))
        return future

    def close(self) -> None:
        """Stop the thread once the calls before run, and wait for it (at most `join_s` for a hung call)."""
        if self._thread.is_alive():
            self._queue.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join(self._join_s)


def _run_calls(calls: queue.SimpleQueue) -> None:
    while (item := calls.get()) is not None:
        future, fn = item
        del item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
                del exc
        del future, fn  # the caller owns the result: never free it here, maybe while the interpreter exits
