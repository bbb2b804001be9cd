"""The router front's limits (serve/http_server.py): flow control, deadlines, the connection cap,
long pipelines, and the malformed requests an adversarial pass found (issue 21)."""
from __future__ import annotations

import asyncio
import json

import pytest
from raw_http import WAIT_S, read_answer, request_bytes, run_server, until

from serve.http_routes import Request, Response, Routes

READ_BYTES = 256 * 1024  # the most asyncio's socket transport reads at once (its `max_size`)


async def _echo(request: Request) -> Response:
    return Response.json({"path": request.path, "size": len(request.body)})


def _routes(gate: asyncio.Event | None = None) -> Routes:
    async def gated(request: Request) -> Response:
        await gate.wait()
        return Response.json({"gated": True})

    routes = Routes()
    routes.add("POST", "/echo", _echo)
    routes.add("GET", "/echo", _echo)
    if gate is not None:
        routes.add("GET", "/gated", gated)
    return routes






def test_reading_pauses_while_a_request_is_answered_and_the_backlog_is_full():
    gate = asyncio.Event()
    body = b"x" * 5000

    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes("GET", "/gated"))
        await until(lambda: any(c.busy for c in server.connections), "the gated request is in flight")
        pipelined = request_bytes("POST", "/echo", body) * 400  # 2 MB behind the request in flight
        writer.write(pipelined)
        (connection,) = server.connections
        await until(lambda: connection.reading_paused, "reading paused")
        held = connection.buffered_bytes
        gate.set()
        answers = [await read_answer(reader) for _ in range(401)]
        writer.close()
        return held, answers, connection.reading_paused

    held, answers, paused_at_end = run_server(scenario, _routes(gate), max_body_bytes=10_000,
                                       max_buffered_bytes=50_000)
    # the limit, plus what one read of the socket carried past it (the parser takes a read whole)
    assert held <= 50_000 + READ_BYTES
    assert [a[0] for a in answers] == [200] * 401 and json.loads(answers[0][2]) == {"gated": True}
    assert all(json.loads(a[2])["size"] == 5000 for a in answers[1:]) and not paused_at_end


def test_a_thousand_pipelined_requests_are_all_answered_in_order():
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        # handler answers and answers without a handler (404, 405) alternate: neither may recurse
        kinds = [("POST", f"/echo?i={i}") if i % 3 == 0 else ("GET", f"/missing/{i}") if i % 3 == 1
                 else ("PUT", "/echo") for i in range(1000)]
        writer.write(b"".join(request_bytes(m, p, b"abc") for m, p in kinds))
        answers = [await read_answer(reader) for _ in kinds]
        writer.close()
        return [a[0] for a in answers]

    statuses = run_server(scenario, _routes())
    assert statuses == [(200, 404, 405)[i % 3] for i in range(1000)]


@pytest.mark.parametrize("sent, phase", [
    (b"", "idle"),  # connected, silent
    (b"GET /echo HTTP/1.1\r\nHost: t\r\n", "head"),  # half a head
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc", "body"),  # half a body
    (request_bytes("GET", "/echo"), "keep-alive"),  # answered, then idle
])
def test_a_connection_that_stalls_is_closed_at_its_deadline(sent, phase):
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(sent)
        answers = []
        if phase == "keep-alive":
            answers.append((await read_answer(reader))[0])
        rest = await asyncio.wait_for(reader.read(), WAIT_S)  # b"" or a 408, then EOF: the server closed
        writer.close()
        return answers, rest, server.expired_connections

    answers, rest, expired = run_server(scenario, _routes(), header_timeout_s=0.2, body_timeout_s=0.2, keep_alive_timeout_s=0.2)
    assert expired == 1
    if phase in ("head", "body"):
        assert rest.startswith(b"HTTP/1.1 408") and b"request_timeout" in rest and phase.encode() in rest
    else:
        assert rest == b"" and answers == ([200] if phase == "keep-alive" else [])


def test_connections_past_the_cap_are_refused_with_503_and_closed():
    async def scenario(server):
        held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        await until(lambda: len(server.connections) == 3, "three connections accepted")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        refused = await asyncio.wait_for(reader.read(), WAIT_S)
        writer.close()
        held[0][1].close()
        await until(lambda: len(server.connections) == 2, "a held connection closed")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes("GET", "/echo"))
        after = await read_answer(reader)
        for _, w in [*held[1:], (reader, writer)]:
            w.close()
        return refused, after[0], server.refused_connections

    refused, after, count = run_server(scenario, _routes(), max_connections=3)
    assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused
    assert b"Connection: close" in refused and after == 200 and count == 1


@pytest.mark.parametrize("raw, status, code", [
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: \xb2\r\n\r\n", 400, "bad_header"),  # '²' in latin-1
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: \xc2\xb2\r\n\r\n", 400, "bad_header"),  # in UTF-8
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", 400, "bad_header"),
    (b"GET /echo HTTP/1.1\nHost: t\n\n", 400, "bad_request_line"),  # bare LF: refused, never a hang
    (b"GET /echo HTTP/1.1\r\n\r\n", 400, "missing_host"),
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431, "head_too_large"),
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20_000, 431, "head_too_large"),  # still arriving
    (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1048577\r\n\r\n", 413, "body_too_large"),
])
def test_malformed_heads_are_refused_by_name_and_the_connection_closes(raw, status, code):
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(raw)
        answer = await read_answer(reader)
        rest = await asyncio.wait_for(reader.read(), WAIT_S)
        writer.close()
        return answer, rest

    (got, headers, body), rest = run_server(scenario, _routes())  # the defaults: 16 KiB heads, 1 MiB bodies
    assert (got, json.loads(body)["error"]["code"]) == (status, code)
    assert headers["connection"] == "close" and rest == b""


def test_a_refusal_behind_pipelined_requests_comes_after_their_answers():
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes("POST", "/echo", b"one") + request_bytes("GET", "/echo") + b"GET /echo HTTP/1.1\r\n\r\n")
        answers = [await read_answer(reader) for _ in range(3)]
        rest = await asyncio.wait_for(reader.read(), WAIT_S)
        writer.close()
        return [a[0] for a in answers], rest

    statuses, rest = run_server(scenario, _routes())
    assert statuses == [200, 200, 400] and rest == b""


def test_bodies_of_requests_answered_without_a_handler_are_not_held():
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"".join(request_bytes("POST", "/missing", b"x" * 1000) for _ in range(100)))
        statuses = [(await read_answer(reader))[0] for _ in range(100)]
        (connection,) = server.connections
        held = connection.buffered_bytes
        writer.close()
        return statuses, held

    statuses, held = run_server(scenario, _routes())
    assert statuses == [404] * 100 and held == 0


def test_a_connection_paused_behind_a_slow_answer_is_not_timed_out():
    """The client is not late while the server does not read: its body deadline waits for the resume."""
    gate = asyncio.Event()

    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes("GET", "/gated") + request_bytes("POST", "/echo", b"y" * 200_000))
        (connection,) = server.connections
        await until(lambda: connection.reading_paused, "reading paused")
        await asyncio.sleep(0.5)  # over twice the body timeout, handler still busy
        gate.set()
        answers = [await read_answer(reader) for _ in range(2)]
        writer.close()
        return [a[0] for a in answers], server.expired_connections

    statuses, expired = run_server(scenario, _routes(gate), body_timeout_s=0.2, max_body_bytes=300_000)
    assert statuses == [200, 200] and expired == 0


def test_the_connection_cap_is_exact_in_a_burst():
    async def scenario(server):
        opened = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", server.port) for _ in range(120)))
        await until(lambda: server.refused_connections + len(server.connections) == 120, "every connection seen")
        held, refused = len(server.connections), server.refused_connections
        answers = await asyncio.gather(*(asyncio.wait_for(reader.read(), 0.5) for reader, _ in opened),
                                       return_exceptions=True)
        for _, writer in opened:
            writer.close()
        return held, refused, sum(isinstance(a, bytes) and a.startswith(b"HTTP/1.1 503") for a in answers)

    held, refused, answered_503 = run_server(scenario, _routes(), max_connections=50)
    assert (held, refused, answered_503) == (50, 70, 70)


@pytest.mark.parametrize("length, status", [(b"0" * 4995 + b"12345", 200), (b"0" * 4990 + b"9" * 10, 413)],
                         ids=["zeros-then-a-small-length", "zeros-then-a-large-length"])
def test_a_content_length_of_thousands_of_digits_is_answered_without_a_traceback(length, status, caplog):
    body = b"x" * 12345 if status == 200 else b""

    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: " + length + b"\r\n\r\n" + body)
        answer = await read_answer(reader)
        writer.close()
        return answer

    got, _, answer = run_server(scenario, _routes())
    assert got == status
    assert (json.loads(answer)["size"] == 12345) if status == 200 else (json.loads(answer)["error"]["code"] == "body_too_large")
    assert not [r for r in caplog.records if r.exc_info]
