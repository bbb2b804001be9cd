"""The router's requests to one node: HTTP/1.1 POSTs over pooled keep-alive connections.

On the request path of every visit, so it is kept lean, like the router's server
(serve/http_server.py): aiohttp's client cost about 0.6 ms more per request than this on the
project's 2-core machine. It speaks only what our nodes answer: a status line, headers and a Content-Length
body. A connection carries one request at a time and goes back to the pool after a complete
answer (unless the node said `Connection: close`).

A request that fails on a pooled connection is retried once on a fresh one: the node may have
closed an idle connection (a restart, its keep-alive timeout). Anything else -- refused, reset,
timed out, an answer that is not HTTP -- raises `ForwardError`: the router takes the node out.
"""
from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable

MAX_IDLE = 64  # idle connections kept per node


class ForwardError(Exception):
    """The node did not answer the request."""


_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class NodeConnections:
    def __init__(self, host: str, port: int, authorization: Callable[[], bytes] = bytes) -> None:
        """`authorization`: the header line(s) each request carries, asked per request (a rotated token)."""
        self.host = host
        self.port = port
        self.authorization = authorization
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """-> (status, body) of the node's answer; `ForwardError` when there is none."""
        pooled = bool(self._idle)
        try:
            return await _within(self._attempt(path, body), timeout_s)
        except asyncio.TimeoutError:
            raise ForwardError(f"no answer within {timeout_s:g} s") from None
        except ForwardError:
            if not pooled:
                raise
        try:
            return await _within(self._attempt(path, body, fresh=True), timeout_s)
        except asyncio.TimeoutError:
            raise ForwardError(f"no answer within {timeout_s:g} s") from None

    async def _attempt(self, path: str, body: bytes, fresh: bool = False) -> tuple[int, bytes]:
        connection = None if fresh or not self._idle else self._idle.pop()
        try:
            if connection is None:
                connection = await asyncio.open_connection(self.host, self.port)
            status, payload, keep = await _exchange(*connection, self.host, path, body, self.authorization())
        except (OSError, EOFError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as err:
            if connection is not None:
                _close(connection)
            raise ForwardError(f"{type(err).__name__}: {err}") from None
        except BaseException:  # a timeout or a cancellation mid-exchange: the connection is unusable
            if connection is not None:
                _close(connection)
            raise
        if keep and len(self._idle) < MAX_IDLE:
            self._idle.append(connection)
        else:
            _close(connection)
        return status, payload

    def close(self) -> None:
        """Close the idle connections (a node taken out, the router stopping)."""
        while self._idle:
            _close(self._idle.pop())


if sys.version_info >= (3, 11):
    async def _within(awaitable, timeout_s: float):
        """`await awaitable`, at most `timeout_s` (asyncio.timeout: no extra task, unlike wait_for)."""
        async with asyncio.timeout(timeout_s):
            return await awaitable
else:  # pragma: no cover - Python 3.10
    async def _within(awaitable, timeout_s: float):
        return await asyncio.wait_for(awaitable, timeout_s)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str,
                    body: bytes, extra_headers: bytes = b"") -> tuple[int, bytes, bool]:
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
                 % (path.encode(), host.encode(), extra_headers, len(body)) + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    status = int(rest[:3])
    length, keep = None, version == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection":
            keep = value == b"keep-alive" or (keep and value != b"close")
        elif name == b"transfer-encoding" and value != b"identity":
            raise ValueError(f"transfer-encoding {value.decode()} is not supported")
    if length is None:
        raise ValueError("an answer without Content-Length")
    return status, await reader.readexactly(length), keep


def _close(connection: _Connection) -> None:
    with contextlib.suppress(Exception):
        connection[1].close()
