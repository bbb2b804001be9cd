"""The background offload worker used when `KVCacheConfig.async_offload` is set.

An offload job is a tuple of user ids. The worker runs jobs in submission order through a
callback that takes the manager lock per user, so a job never races with another manager
call: it sees the state of the moment it runs (offloading is idempotent, "make the host
match the device"). The worker holds the manager only weakly, so a manager that is
dropped without `close()` still gets collected and its thread stops.
"""
from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable

_STOP = object()


class OffloadWorker:
    def __init__(self, run: weakref.WeakMethod) -> None:
        self._run: Callable[[], Callable[[tuple[int, ...]], None] | None] = run
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="kvcache-offload", daemon=True)
        self._thread.start()

    def submit(self, user_ids: tuple[int, ...]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("The offload worker is closed.")
        self._queue.put(user_ids)

    def wait(self) -> None:
        """Block until every submitted job ran; re-raise the first error a job raised."""
        self._queue.join()
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("An asynchronous offload failed.") from error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                self._queue.task_done()
                return
            run = self._run()
            try:
                if run is not None:
                    run(job)
            except BaseException as exc:  # surfaced by wait()
                if self._error is None:
                    self._error = exc
            finally:
                run = None  # do not keep the manager alive while blocked on the queue
                self._queue.task_done()
