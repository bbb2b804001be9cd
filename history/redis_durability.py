"""What makes the Redis history store's write answers true: the server's fsync settings, checked at
start and again while it runs, and what an unanswered append means.

* **Fsync.** An acknowledged append must survive a crash, so the server must run with `appendonly yes`
  and `appendfsync always` (history/redis_store.py). A Lua script cannot read the config, so
  `FsyncGuard.recheck()` runs CONFIG GET before an append once `check_interval_s` has passed since the
  last check that passed: a server switched to `appendfsync everysec` at run time takes appends for at
  most that long, then every append is refused (HistoryUnavailableError, nothing stored) until it is
  durable again.
* **Outcome.** `append_outcome()` wraps the script call: an error before the command left (connecting
  failed) or one the server answered stored nothing (HistoryUnavailableError); a call sent and not
  answered (a timeout, a connection lost while waiting) may have been applied, whole, as a stalled
  server that resumes does (AppendOutcomeUnknownError: retry with the same batch_id).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import redis

from history.base import AppendOutcomeUnknownError, HistoryUnavailableError

DEFAULT_FSYNC_CHECK_INTERVAL_S = 1.0


class FsyncGuard:
    """The server's durability settings: `check()` raises ValueError when they could lose an acknowledged
    append; `recheck()` runs it again when due, as a refusal of the write."""

    def __init__(self, client: redis.Redis, description: str, required: bool,
                 check_interval_s: float = DEFAULT_FSYNC_CHECK_INTERVAL_S) -> None:
        self._client = client
        self.description = description
        self.required = required
        self.check_interval_s = check_interval_s
        self._checked_at = -float("inf")  # time.monotonic() when the last check that passed began
        self._lock = threading.Lock()
        if required:
            self.check()

    def _due(self) -> bool:
        return time.monotonic() - self._checked_at >= self.check_interval_s

    def recheck(self) -> None:
        """Before an append: HistoryUnavailableError when the server is (now) not durable."""
        if not self.required or not self._due():
            return
        with self._lock:  # one check for the appends of every thread that found it due
            if not self._due():
                return
            try:
                self.check()
            except ValueError as err:
                raise HistoryUnavailableError(f"refusing writes, nothing stored: {err}") from None

    def check(self) -> None:
        started = time.monotonic()
        try:
            config = self._client.config_get("appendonly") | self._client.config_get("appendfsync")
        except redis.ResponseError as err:  # CONFIG renamed away or not permitted to this user
            raise ValueError(
                f"{self.description}: cannot read the server's appendonly/appendfsync settings ({err}); the "
                "history store needs `appendonly yes` and `appendfsync always` so that an acknowledged append "
                "is durable. Allow CONFIG GET, or pass require_fsync=False if you accept losing acknowledged "
                "appends in a server crash") from err
        except redis.RedisError as err:
            raise HistoryUnavailableError(
                f"{self.description}: checking the server's durability settings: {err}") from err
        if config.get("appendonly") != "yes" or config.get("appendfsync") != "always":
            raise ValueError(
                f"{self.description} runs with appendonly={config.get('appendonly')}, "
                f"appendfsync={config.get('appendfsync')}: an acknowledged append could be lost in a crash. Set "
                "`appendonly yes` and `appendfsync always` in redis.conf (or CONFIG SET appendonly yes, then "
                "CONFIG SET appendfsync always, and CONFIG REWRITE), or pass require_fsync=False to accept the loss")
        self._checked_at = started


@contextlib.contextmanager
def append_outcome(description: str) -> Iterator[None]:
    """Around an append's call: the error that says what it stored (see the module docstring)."""
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as err:
        if _never_sent(err):
            raise HistoryUnavailableError(f"{description}: append failed, nothing stored: {err}") from err
        raise AppendOutcomeUnknownError(
            f"{description}: no answer to the append ({err}): it may have been stored; retry it with the same "
            "batch_id to learn its result") from err
    except redis.RedisError as err:
        raise HistoryUnavailableError(f"{description}: append failed, nothing stored: {err}") from err


def _never_sent(err: redis.RedisError) -> bool:
    """A connection or timeout error raised before the command left: connecting failed (redis-py says
    "connecting to"), or the server refused the connection (authentication, still loading its data).
    Anything else may have been sent, and is reported as such."""
    return isinstance(err, (redis.AuthenticationError, redis.BusyLoadingError)) or "connecting to" in str(err)
