"""The router's forwarding client against a real aiohttp server: keep-alive reuse, stale connections, failures."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from benchmark.harness.launch import free_port
from serve.forwarder import ForwardError, NodeConnections


async def serve(handler, port: int | None = None) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = port or free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def test_answers_pass_through_on_reused_connections_and_survive_a_node_restart():
    seen = []

    async def echo(request):
        body = await request.read()
        seen.append(request.transport)
        return web.json_response({"echo": body.decode()}, status=201)

    async def main():
        runner, port = await serve(echo)
        conns = NodeConnections("127.0.0.1", port)
        first = await conns.post("/score", b'{"a": 1}', 5.0)
        second = await conns.post("/score", b'{"a": 2}', 5.0)
        assert len({id(t) for t in seen}) == 1  # one keep-alive connection
        await runner.cleanup()  # the node restarts: the pooled connection is dead
        runner, _ = await serve(echo, port)
        third = await conns.post("/score", b'{"a": 3}', 5.0)  # retried on a fresh connection
        await runner.cleanup()
        conns.close()
        return first, second, third

    first, second, third = asyncio.run(asyncio.wait_for(main(), 30))
    assert first == (201, b'{"echo": "{\\"a\\": 1}"}') and second[0] == 201 and third[0] == 201


def test_refused_slow_and_streaming_nodes_raise_forward_error():
    async def slow(request):
        await asyncio.sleep(1)
        return web.json_response({})

    async def streaming(request):
        response = web.StreamResponse()
        await response.prepare(request)  # chunked: no Content-Length
        await response.write(b"{}")
        await response.write_eof()
        return response

    async def main():
        with pytest.raises(ForwardError, match="ConnectionRefused"):
            await NodeConnections("127.0.0.1", free_port()).post("/score", b"{}", 2.0)
        runner, port = await serve(slow)
        with pytest.raises(ForwardError, match=r"no answer within 0\.2 s"):
            await NodeConnections("127.0.0.1", port).post("/score", b"{}", 0.2)
        await runner.cleanup()
        runner, port = await serve(streaming)
        with pytest.raises(ForwardError, match="chunked is not supported"):
            await NodeConnections("127.0.0.1", port).post("/score", b"{}", 2.0)
        await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 30))
