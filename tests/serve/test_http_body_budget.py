"""The router front's budget for request bodies held across all connections (serve/http_budget.py):
issue 21's 50 clients streaming 1 MiB bodies grew the router by what they sent, per-connection
flow control notwithstanding."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from raw_http import read_answer, request_bytes, run_server, until

from serve.http_budget import BodyBudget
from serve.http_routes import Request, Response, Routes


class _Waiter:
    def __init__(self) -> None:
        self.admitted_bytes: list[int] = []

    def admitted(self, nbytes: int) -> None:
        self.admitted_bytes.append(nbytes)


def test_requests_past_the_budget_wait_in_arrival_order_and_are_admitted_as_bytes_are_released():
    budget = BodyBudget(limit_bytes=100)
    first, second, third = _Waiter(), _Waiter(), _Waiter()
    assert budget.reserve(first, 60)
    assert not budget.reserve(second, 50)
    assert not budget.reserve(third, 10)  # it would fit, but does not overtake the one waiting
    assert (budget.held_bytes, budget.waiting, budget.waits) == (60, 2, 2)
    budget.release(60)
    assert second.admitted_bytes == [50] and third.admitted_bytes == [10]
    assert (budget.held_bytes, budget.waiting, budget.peak_bytes) == (60, 0, 60)


def test_a_body_larger_than_the_budget_is_admitted_alone_rather_than_never():
    budget = BodyBudget(limit_bytes=100)
    big, small = _Waiter(), _Waiter()
    assert budget.reserve(big, 500)
    assert not budget.reserve(small, 1)
    budget.release(500)
    assert small.admitted_bytes == [1]


def test_a_withdrawn_waiter_is_skipped_and_a_body_already_read_is_taken_over_the_limit():
    budget = BodyBudget(limit_bytes=100)
    holder, gone, next_in_line = _Waiter(), _Waiter(), _Waiter()
    budget.reserve(holder, 90)
    budget.reserve(gone, 50)
    budget.reserve(next_in_line, 5)
    budget.withdraw(gone)  # its connection closed: the next one fits now
    assert gone.admitted_bytes == [] and next_in_line.admitted_bytes == [5]
    late = _Waiter()
    assert not budget.reserve(late, 40)
    assert budget.take_waiting(late) == 40 and budget.held_bytes == 135 and budget.waiting == 0
    assert budget.take_waiting(late) == 0


@pytest.mark.parametrize("nbytes", [-1, 1000])
def test_releasing_what_is_not_held_is_refused(nbytes):
    budget = BodyBudget(limit_bytes=100)
    budget.reserve(_Waiter(), 10)
    with pytest.raises(ValueError, match="releasing"):
        budget.release(nbytes)
    assert budget.held_bytes == 10


def test_a_request_past_the_budget_is_not_read_until_answered_requests_free_it():
    gate = asyncio.Event()
    body = b"z" * 100_000

    async def gated(request: Request) -> Response:
        await gate.wait()
        return Response.json({"size": len(request.body)})

    routes = Routes()
    routes.add("POST", "/gated", gated)

    async def scenario(server):
        budget, clients = server.body_budget, []
        for i in range(2):  # two admitted bodies, held by handlers that wait
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(request_bytes("POST", "/gated", body))
            clients.append((reader, writer))
            await until(lambda n=i + 1: sum(c.busy for c in server.connections) == n, f"{i + 1} requests in flight")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        head = request_bytes("POST", "/gated", body)[:-len(body)]
        writer.write(head)
        await until(lambda: budget.waiting == 1, "the third request waits for the budget")
        writer.write(body)  # sent, but the front must not read it
        clients.append((reader, writer))
        await asyncio.sleep(0.5)  # past the body timeout: waiting is not the client's time
        waiting = [c for c in server.connections if not c.busy]
        state = (budget.held_bytes, len(waiting), waiting[0].reading_paused, waiting[0].buffered_bytes,
                 server.expired_connections)
        gate.set()
        answers = [await read_answer(r) for r, _ in clients]
        for _, w in clients:
            w.close()
        await until(lambda: budget.held_bytes == 0, "every reservation released")
        return state, answers, budget.peak_bytes, budget.waits

    state, answers, peak, waits = run_server(scenario, routes, max_held_body_bytes=250_000,
                                             body_timeout_s=0.2, max_body_bytes=200_000)
    assert state == (200_000, 1, True, 0, 0)
    assert [a[0] for a in answers] == [200] * 3
    assert [json.loads(a[2])["size"] for a in answers] == [100_000] * 3
    assert peak == 200_000 and waits == 1


def test_the_router_process_loads_neither_torch_nor_pyarrow():
    """Its idle size is the base of the memory bound above: parsing events must not pull in the
    columnar and model stacks (pyarrow alone doubled it)."""
    code = "import sys, serve.router; print(sorted(m for m in ('torch', 'pyarrow', 'pandas') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
