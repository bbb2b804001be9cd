"""The router's HTTP/1.1 front (serve/http_server.py), spoken to over raw sockets."""
from __future__ import annotations

import asyncio
import http.client
import json

import pytest
from raw_http import read_answer, request_bytes, run_server

from serve.http_routes import Request, Response, Routes
from serve.http_server import HttpServer


async def _echo(request: Request) -> Response:
    return Response.json({"method": request.method, "path": request.path, "body": request.body.decode(),
                          "tail": request.path_tail, "expect": request.headers.get("expect", "")})


async def _boom(request: Request) -> Response:
    raise RuntimeError("handler bug")


def _routes(slow: asyncio.Event | None = None) -> Routes:
    async def slow_handler(request: Request) -> Response:
        await slow.wait()
        return Response.json({"slow": True})

    routes = Routes()
    routes.add("POST", "/echo", _echo)
    routes.add("GET", "/echo", _echo)
    routes.add("GET", "/boom", _boom)
    routes.add_prefix("GET", "/item/", _echo)
    if slow is not None:
        routes.add("GET", "/slow", slow_handler)
    return routes




def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes("POST", "/echo", b'{"a": 1}'))
        first = await read_answer(reader)
        # two requests in one write, the second split across the next write
        both = request_bytes("POST", "/echo?x=1", b"one") + request_bytes("POST", "/echo", b"second-body")
        writer.write(both[:-4])
        await asyncio.sleep(0.05)
        writer.write(both[-4:])
        second, third = await read_answer(reader), await read_answer(reader)
        writer.close()
        return first, second, third

    first, second, third = run_server(scenario, _routes())
    assert [a[0] for a in (first, second, third)] == [200, 200, 200]
    assert json.loads(first[2])["body"] == '{"a": 1}'
    assert json.loads(second[2]) == {"method": "POST", "path": "/echo", "body": "one", "tail": "", "expect": ""}
    assert json.loads(third[2])["body"] == "second-body"
    assert "connection" not in first[1]


def test_expect_100_continue_is_honoured():
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request_bytes("POST", "/echo", extra="Expect: 100-continue\r\n").replace(
            b"Content-Length: 0", b"Content-Length: 5"))
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(b"hello")
        answer = await read_answer(reader)
        writer.close()
        return interim, answer

    interim, (status, _, body) = run_server(scenario, _routes())
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    assert status == 200 and json.loads(body)["body"] == "hello"


@pytest.mark.parametrize("raw, status, code", [
    (b"NONSENSE\r\n\r\n", 400, "bad_request_line"),
    (b"GET /echo HTTP/2.0\r\n\r\n", 505, "http_version_not_supported"),
    (b"GET /echo HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n", 400, "bad_header"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: ten\r\n\r\n", 400, "bad_header"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400, "bad_header"),
    (b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 501,
     "transfer_encoding_not_supported"),
    (b"POST /echo HTTP/1.1\r\nContent-Length: 2000\r\n\r\n", 413, "body_too_large"),
    (b"GET /echo HTTP/1.1\r\nX-Big: " + b"a" * 5000 + b"\r\n", 431, "head_too_large"),
])
def test_malformed_requests_get_a_named_error_and_the_connection_closes(raw, status, code):
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(raw)
        answer = await read_answer(reader)
        rest = await asyncio.wait_for(reader.read(), 5)  # b"" once the server closed
        writer.close()
        return answer, rest

    (got, headers, body), rest = run_server(scenario, _routes(), max_body_bytes=1000, max_head_bytes=4096)
    assert got == status and json.loads(body)["error"]["code"] == code
    assert headers["connection"] == "close" and rest == b""


def test_routes_404_405_prefix_and_a_failing_handler_keeps_the_connection():
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        answers = []
        for method, path in (("GET", "/nowhere"), ("DELETE", "/echo"), ("GET", "/item/42"), ("GET", "/item/"),
                             ("GET", "/boom"), ("GET", "/echo")):
            writer.write(request_bytes(method, path))
            answers.append(await read_answer(reader))
        writer.close()
        return answers

    missing, wrong_method, prefixed, bare_prefix, boom, after = run_server(scenario, _routes())
    assert missing[0] == 404 and json.loads(missing[2])["error"]["code"] == "not_found"
    assert wrong_method[0] == 405 and wrong_method[1]["allow"] == "GET, POST"
    assert prefixed[0] == 200 and json.loads(prefixed[2])["tail"] == "42"
    assert bare_prefix[0] == 404
    assert boom[0] == 500 and "handler bug" in json.loads(boom[2])["error"]["message"]
    assert after[0] == 200


def test_http10_closes_unless_keep_alive_and_http_client_interoperates():
    async def scenario(server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /echo HTTP/1.0\r\n\r\n")
        answer = await read_answer(reader)
        rest = await asyncio.wait_for(reader.read(), 5)
        writer.close()

        def with_http_client():
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            out = []
            for body in (b"x", b"y" * 3000):
                conn.request("POST", "/echo", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                out.append((resp.status, json.loads(resp.read())["body"]))
            conn.close()
            return out
        return answer, rest, await asyncio.to_thread(with_http_client)

    (status, headers, _), rest, via_client = run_server(scenario, _routes())
    assert status == 200 and headers["connection"] == "close" and rest == b""
    assert via_client == [(200, "x"), (200, "y" * 3000)]


def test_stop_lets_the_request_in_hand_finish_then_closes():
    slow = asyncio.Event()

    async def main():
        server = HttpServer(_routes(slow))
        await server.start("127.0.0.1", 0)
        port = server.port
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", server.port)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", server.port)
        busy_writer.write(request_bytes("GET", "/slow"))
        idle_writer.write(request_bytes("GET", "/echo"))
        await read_answer(idle_reader)
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(server.stop(timeout_s=5.0))
        idle_rest = await asyncio.wait_for(idle_reader.read(), 5)  # the idle connection closes at once
        assert not stopping.done()
        slow.set()
        answer = await read_answer(busy_reader)
        await asyncio.wait_for(stopping, 5)
        busy_rest = await asyncio.wait_for(busy_reader.read(), 5)
        refused = None
        try:
            await asyncio.open_connection("127.0.0.1", port)
        except OSError as err:
            refused = err
        return idle_rest, answer, busy_rest, refused

    idle_rest, (status, headers, body), busy_rest, refused = asyncio.run(main())
    assert idle_rest == b"" and busy_rest == b""
    assert status == 200 and json.loads(body) == {"slow": True} and headers["connection"] == "close"
    assert refused is not None
