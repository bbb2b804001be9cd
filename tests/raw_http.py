"""Speaking HTTP/1.1 over raw sockets to the router's front (serve/http_server.py), for its tests:
byte-exact requests, answers read with bounded waits, a server on a free loopback port."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from serve.http_routes import Routes
from serve.http_server import HttpServer, ServerLimits

WAIT_S = 5.0  # bound on every wait: a hang fails the test instead of blocking it


def request_bytes(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """-> (status, lower-case headers, body) of the next answer on the connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), WAIT_S)
    return int(lines[0].split(" ")[1]), headers, body


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait, bounded, for a condition the server reaches on its own."""
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def run_server(scenario: Callable[[HttpServer], Awaitable], routes: Routes, **limits):
    """scenario(server) on a fresh event loop, with a server listening on a free loopback port."""
    async def main():
        server = HttpServer(routes, ServerLimits(**limits))
        await server.start("127.0.0.1", 0)
        try:
            return await scenario(server)
        finally:
            await server.stop(timeout_s=2.0)
    return asyncio.run(main())
