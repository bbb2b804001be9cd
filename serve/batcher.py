"""Dynamic batching: requests wait until a batch is full or the oldest one has waited `max_wait_s`.

Batches run one at a time on an executor thread (a node has one compute thread; while a batch
runs, the next one fills up). A batch holds each key (user) at most once: a user's second
request waits for a later batch, so a user's requests run in arrival order, each visit on the
cache the previous one left. Requests of other users may overtake it.

    batcher = DynamicBatcher(run_batch, key=lambda q: q.user_id, max_batch_size=8, max_wait_s=0.002)
    batcher.start()                      # inside the running event loop
    done = await batcher.submit(query)   # Batched(result, batch_size, queue_s, run_s)
    await batcher.close()                # serve what is queued, then stop

`run_batch(items)` returns one result per item, in order; a result that is an exception instance
fails that item only, and an exception raised fails the whole batch.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class QueueFullError(Exception):
    """The batcher already holds `max_queue` requests: the caller should shed load (HTTP 503)."""


class BatcherClosedError(Exception):
    """The batcher is shutting down and takes no new requests."""


class Batched(NamedTuple, Generic[R]):
    result: R
    batch_size: int
    queue_s: float  # arrival -> its batch started
    run_s: float  # the batch's run time


@dataclass
class _Waiting:
    item: object
    key: Hashable
    future: asyncio.Future
    arrived: float


class DynamicBatcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R | BaseException]],
        key: Callable[[T], Hashable],
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int | None = None,
        executor: Executor | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1 or None, got {max_queue}")
        self._run_batch = run_batch
        self._key = key
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="batcher")
        self._waiting: deque[_Waiting] = deque()
        self._running = 0  # items of the batch being run
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False

    @property
    def queue_depth(self) -> int:
        """Requests waiting or being run."""
        return len(self._waiting) + self._running

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        if self._task is not None:
            raise RuntimeError("DynamicBatcher.start() called twice")
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="dynamic-batcher")

    async def submit(self, item: T) -> Batched[R]:
        """Queue `item` and wait for its batch; `QueueFullError` / `BatcherClosedError` refuse it at once."""
        if self._task is None:
            raise RuntimeError("DynamicBatcher.submit() before start()")
        if self._closing:
            raise BatcherClosedError("the node is shutting down")
        if self.max_queue is not None and self.queue_depth >= self.max_queue:
            raise QueueFullError(f"{self.queue_depth} requests queued (max_queue={self.max_queue})")
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(item, self._key(item), future, time.monotonic()))
        self._wakeup.set()
        return await future

    async def close(self, drain: bool = True) -> None:
        """Take no new requests; serve the queued ones (`drain`) or fail them; stop the loop."""
        self._closing = True
        if self._task is None:
            return
        if not drain:
            while self._waiting:
                waiting = self._waiting.popleft()
                if not waiting.future.done():
                    waiting.future.set_exception(BatcherClosedError("the node shut down before serving this request"))
        self._wakeup.set()
        await self._task
        if self._owns_executor:
            self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            self._running = len(batch)
            started = time.monotonic()
            try:
                results = await loop.run_in_executor(self._executor, self._run_batch, [w.item for w in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
            except Exception as err:  # the whole batch failed: every caller hears why
                results = [err] * len(batch)
            finally:
                self._running = 0
            ran = time.monotonic() - started
            for waiting, result in zip(batch, results):
                if waiting.future.done():  # the caller went away
                    continue
                if isinstance(result, BaseException):
                    waiting.future.set_exception(result)
                else:
                    waiting.future.set_result(Batched(result, len(batch), started - waiting.arrived, ran))

    async def _next_batch(self) -> list[_Waiting] | None:
        """Wait until a batch is due (full, or its oldest request waited max_wait_s) and take it."""
        while True:
            while self._waiting and self._waiting[0].future.done():  # cancelled callers
                self._waiting.popleft()
            if not self._waiting:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            remaining = self._waiting[0].arrived + self.max_wait_s - time.monotonic()
            if remaining <= 0 or self._closing or self._distinct_keys() >= self.max_batch_size:
                return self._take()
            self._wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    def _distinct_keys(self) -> int:
        keys: set[Hashable] = set()
        for waiting in self._waiting:
            keys.add(waiting.key)
            if len(keys) >= self.max_batch_size:
                break
        return len(keys)

    def _take(self) -> list[_Waiting]:
        """The oldest request of up to max_batch_size keys; the others keep their order."""
        batch: list[_Waiting] = []
        keys: set[Hashable] = set()
        kept: deque[_Waiting] = deque()
        while self._waiting:
            waiting = self._waiting.popleft()
            if waiting.future.done():
                continue
            if len(batch) < self.max_batch_size and waiting.key not in keys:
                batch.append(waiting)
                keys.add(waiting.key)
            else:
                kept.append(waiting)
        self._waiting = kept
        return batch
