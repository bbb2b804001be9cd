"""Dynamic batching without HTTP: batch size and wait bounds, one user per batch in order, load shedding, drain."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serve.batcher import BatcherClosedError, DynamicBatcher, QueueFullError


class Recorder:
    """A run_batch that records its batches and answers (user, seq) -> seq * 10; `gate` holds a batch."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[list[tuple[int, int]]] = []
        self.gate = gate

    def __call__(self, items):
        if self.gate is not None:
            self.gate.wait(5)
        self.batches.append(list(items))
        return [seq * 10 for _, seq in items]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_full_batch_goes_at_once_and_a_lone_request_after_max_wait():
    async def main():
        recorder = Recorder()
        batcher = DynamicBatcher(recorder, key=lambda item: item[0], max_batch_size=4, max_wait_s=5.0)
        batcher.start()
        started = time.monotonic()
        done = await asyncio.gather(*(batcher.submit((u, u)) for u in range(4)))
        full_after = time.monotonic() - started
        assert [d.result for d in done] == [0, 10, 20, 30] and {d.batch_size for d in done} == {4}
        await batcher.close()

        recorder = Recorder()
        batcher = DynamicBatcher(recorder, key=lambda item: item[0], max_batch_size=4, max_wait_s=0.05)
        batcher.start()
        started = time.monotonic()
        lone = await batcher.submit((7, 1))
        lone_after = time.monotonic() - started
        await batcher.close()
        return full_after, lone, lone_after

    full_after, lone, lone_after = run(main())
    assert full_after < 2.0  # did not wait for max_wait_s=5
    assert lone.batch_size == 1 and lone.result == 10
    assert 0.04 <= lone_after < 2.0 and lone.queue_s >= 0.04


def test_requests_arriving_while_a_batch_runs_form_the_next_batch():
    async def main():
        gate = threading.Event()
        recorder = Recorder(gate)
        batcher = DynamicBatcher(recorder, key=lambda item: item[0], max_batch_size=8, max_wait_s=0.0)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit((0, 0)))
        await asyncio.sleep(0.05)  # the first batch is running (held by the gate)
        rest = [asyncio.ensure_future(batcher.submit((u, u))) for u in range(1, 6)]
        await asyncio.sleep(0.05)
        assert batcher.queue_depth == 6
        gate.set()
        await asyncio.gather(first, *rest)
        await batcher.close()
        return recorder.batches

    batches = run(main())
    assert [len(b) for b in batches] == [1, 5]


def test_a_user_appears_once_per_batch_and_its_requests_keep_their_order():
    async def main():
        gate = threading.Event()
        recorder = Recorder(gate)
        batcher = DynamicBatcher(recorder, key=lambda item: item[0], max_batch_size=3, max_wait_s=0.0)
        batcher.start()
        blocker = asyncio.ensure_future(batcher.submit((99, 0)))
        await asyncio.sleep(0.05)
        order = [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (4, 1), (2, 2)]
        futures = [asyncio.ensure_future(batcher.submit(item)) for item in order]
        await asyncio.sleep(0.05)
        gate.set()
        results = await asyncio.gather(blocker, *futures)
        await batcher.close()
        return recorder.batches, [r.result for r in results[1:]]

    batches, results = run(main())
    assert results == [10, 20, 10, 30, 10, 10, 20]
    for batch in batches:
        users = [u for u, _ in batch]
        assert len(users) == len(set(users)) and len(batch) <= 3
    served = [item for batch in batches[1:] for item in batch]
    for user in (1, 2):  # each user's requests run in arrival order
        assert [seq for u, seq in served if u == user] == sorted(seq for u, seq in served if u == user)
    assert batches[1] == [(1, 1), (2, 1), (3, 1)]  # other users fill the batch past user 1's second request


def test_a_full_queue_sheds_load_and_a_closed_batcher_refuses():
    async def main():
        gate = threading.Event()
        batcher = DynamicBatcher(Recorder(gate), key=lambda item: item[0], max_batch_size=2, max_wait_s=0.0, max_queue=3)
        batcher.start()
        futures = [asyncio.ensure_future(batcher.submit((u, u))) for u in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="max_queue=3"):
            await batcher.submit((9, 9))
        gate.set()
        close = asyncio.ensure_future(batcher.close(drain=True))
        await asyncio.sleep(0)
        with pytest.raises(BatcherClosedError):
            await batcher.submit((8, 8))
        await close
        return [f.result().result for f in futures]  # drained: every queued request was served

    assert run(main()) == [0, 10, 20]


def test_a_failing_batch_fails_its_requests_only_and_per_item_errors_stay_per_item():
    calls = []

    def flaky(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("device on fire")
        return [ValueError(f"bad {u}") if u == 2 else u for u, _ in items]

    async def main():
        batcher = DynamicBatcher(flaky, key=lambda item: item[0], max_batch_size=4, max_wait_s=0.0)
        batcher.start()
        with pytest.raises(RuntimeError, match="device on fire"):
            await batcher.submit((1, 0))
        outcomes = await asyncio.gather(*(batcher.submit((u, 0)) for u in (1, 2, 3)), return_exceptions=True)
        await batcher.close()
        return outcomes

    outcomes = run(main())
    assert outcomes[0].result == 1 and outcomes[2].result == 3
    assert isinstance(outcomes[1], ValueError) and "bad 2" in str(outcomes[1])


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": 0, "max_wait_s": 0.0}, "max_batch_size"),
    ({"max_batch_size": 1, "max_wait_s": -1.0}, "max_wait_s"),
    ({"max_batch_size": 1, "max_wait_s": 0.0, "max_queue": 0}, "max_queue"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicBatcher(Recorder(), key=lambda item: item[0], **kwargs)
