"""The HTTP/1.1 front of router and node: a listening socket, its connections (serve/http_connection.py),
their limits.

The router adds a second loopback hop to every visit, so its front stays on bare asyncio
protocols rather than a framework, with a maintained parser (llhttp, through httptools) doing the
wire format. Nodes serve on the same front, so that a client holds a node no longer and no more
than a router: the same deadlines, connection cap and body limits (`add_limit_arguments`).

What it speaks: HTTP/1.0 and 1.1 requests with a Content-Length body (or none), keep-alive,
pipelining (answered in order, one at a time), `Expect: 100-continue`. What it refuses, with a
JSON error and the connection closed: a malformed request (400, llhttp's reason in the message),
HTTP/1.1 without Host (400), a head over `max_head_bytes` (431), a body over `max_body_bytes`
(413), a Transfer-Encoding body (501), another HTTP version (505), a request begun and not
finished in time (408), and a connection past `max_connections` (503). Request bodies held at once,
over all connections, are bounded by `max_held_body_bytes`: a request past it waits, unread. A handler that raises gets
a 500; the connection stays usable.

    server = HttpServer(routes, ServerLimits(max_connections=10_000))
    await server.start("127.0.0.1", 8000)
    ...
    await server.stop(timeout_s=10.0)              # in-flight requests finish (bounded), then close
"""
from __future__ import annotations

import asyncio
import contextlib

from serve.http_budget import BodyBudget
from serve.http_connection import Connection
from serve.http_limits import ServerLimits
from serve.http_routes import Request, Response, Routes, error_response

__all__ = ["HttpServer", "Request", "Response", "Routes", "ServerLimits", "error_response"]


class _Refuser(asyncio.Protocol):
    """A connection past the cap: told so at once, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(error_response(
            503, "too_many_connections", "the server holds its maximum of connections; retry later"
        ).encode(keep_alive=False))
        transport.close()


class HttpServer:
    def __init__(self, routes: Routes, limits: ServerLimits | None = None) -> None:
        self.routes = routes
        self.limits = limits or ServerLimits()
        self.connections: set[Connection] = set()
        self.body_budget = BodyBudget(self.limits.max_held_body_bytes)
        self.refused_connections = 0  # past max_connections
        self.expired_connections = 0  # closed at a deadline
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    @property
    def port(self) -> int:
        """The port listened on (the one the OS chose for port 0)."""
        return self._server.sockets[0].getsockname()[1]

    def _accept(self) -> asyncio.Protocol:
        """Counted from the accept, not from `connection_made`: the loop accepts a burst of connections
        before it makes any of them, and each of them must see the ones accepted before it."""
        if len(self.connections) >= self.limits.max_connections:
            self.refused_connections += 1
            return _Refuser()
        connection = Connection(self)
        self.connections.add(connection)
        return connection

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, host, port, reuse_address=True)
        self._sweeper = loop.create_task(self._sweep_deadlines(), name="http-deadlines")

    async def _sweep_deadlines(self) -> None:
        """Close connections past their deadline. One sweep for all of them keeps the per-request cost
        at setting a float (no timer per request); a deadline is met within a quarter of the shortest
        timeout late."""
        limits = self.limits
        interval = min(1.0, limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_timeout_s) / 4
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for connection in [c for c in self.connections if c.deadline is not None and c.deadline <= now]:
                self.expired_connections += 1
                connection.expire()

    async def stop(self, timeout_s: float) -> None:
        """Stop listening; let the requests being answered finish (at most `timeout_s`); close every connection."""
        if self._server is None:
            return
        self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for connection in list(self.connections):
            connection.closing = True
            if not connection.busy:
                connection.close()
        in_flight = [c.wait_answered() for c in self.connections if c.busy]
        if in_flight:
            await asyncio.wait([asyncio.ensure_future(w) for w in in_flight], timeout=timeout_s)
        for connection in list(self.connections):
            connection.close()
        await self._server.wait_closed()
        self._server = None
