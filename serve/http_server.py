"""A small HTTP/1.1 server on asyncio protocols: the router's front.

The router adds a second loopback hop to every visit, so its front is kept as lean as its
forwarder (serve/forwarder.py): on the project's 2-core machine the router with aiohttp's server
added 0.2-0.4 ms more per request than with this one (paired medians, docs/serving.md, "The
router's overhead"). The node keeps aiohttp, where the model's time dwarfs the server's.

What it speaks: HTTP/1.0 and 1.1 requests with a Content-Length body (or none), keep-alive,
pipelining (answered in order, one at a time), `Expect: 100-continue`. What it refuses, with a
JSON error and the connection closed: a malformed request line or header (400), a head over
`max_head_bytes` (431), a body over `max_body_bytes` (413), a Transfer-Encoding body (501).
A handler that raises gets a 500; the connection stays usable.

    routes = Routes()
    routes.add("GET", "/health", health)           # async def health(req: Request) -> Response
    routes.add_prefix("GET", "/route/", route)     # req.path_tail: what follows the prefix
    server = HttpServer(routes)
    await server.start("127.0.0.1", 8000)
    ...
    await server.stop(timeout_s=10.0)              # in-flight requests finish (bounded), then close
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from http import HTTPStatus

log = logging.getLogger("serve.http")


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # without the query string
    headers: dict[str, str]  # lower-case names
    body: bytes
    path_tail: str = ""  # for a prefix route: what follows the prefix


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, doc: object, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Response:
        return cls(status, json.dumps(doc).encode(), headers=headers)


Handler = Callable[[Request], Awaitable[Response]]


def error_response(status: int, code: str, message: str) -> Response:
    return Response.json({"error": {"code": code, "message": message}}, status)


@dataclass
class Routes:
    """(method, path) -> handler: exact paths, then prefixes (the first added that matches)."""

    exact: dict[str, dict[str, Handler]] = field(default_factory=dict)
    prefixes: list[tuple[str, str, Handler]] = field(default_factory=list)

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.exact.setdefault(path, {})[method] = handler

    def add_prefix(self, method: str, prefix: str, handler: Handler) -> None:
        self.prefixes.append((prefix, method, handler))

    def resolve(self, method: str, path: str) -> tuple[Handler | None, str, Response | None]:
        """-> (handler, path tail, None), or (None, "", the 404 / 405 to answer)."""
        by_method, tail = self.exact.get(path), ""
        if by_method is None:
            by_method = {}
            for prefix, m, handler in self.prefixes:
                if path.startswith(prefix) and len(path) > len(prefix) and m not in by_method:
                    by_method[m], tail = handler, path[len(prefix):]
        if not by_method:
            return None, "", error_response(404, "not_found", f"no route for {path}")
        if method not in by_method:
            allowed = ", ".join(sorted(by_method))
            refusal = error_response(405, "method_not_allowed", f"{method} {path}: allowed {allowed}")
            return None, "", replace(refusal, headers=(("Allow", allowed),))
        return by_method[method], tail, None


class _Refused(Exception):
    """A request the server answers itself and then closes the connection for."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.response = error_response(status, code, message)


@dataclass
class _Head:
    method: str
    path: str
    headers: dict[str, str]
    body_length: int
    keep_alive: bool


def _parse_head(head: bytes, max_body_bytes: int) -> _Head:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith(b"/"):
        raise _Refused(400, "bad_request_line", f"malformed request line {lines[0][:80]!r}")
    version = parts[2]
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise _Refused(505, "http_version_not_supported", f"{version[:16]!r}: this server speaks HTTP/1.0 and 1.1")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise _Refused(400, "bad_header", f"malformed header line {line[:80]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip().decode("latin-1")
        if key == "content-length" and key in headers and headers[key] != text:
            raise _Refused(400, "bad_header", "conflicting Content-Length headers")
        headers[key] = text
    if "transfer-encoding" in headers:
        raise _Refused(501, "transfer_encoding_not_supported",
                       f"Transfer-Encoding {headers['transfer-encoding']!r} is not supported: send a Content-Length body")
    length_text = headers.get("content-length", "0")
    if not length_text.isdigit():
        raise _Refused(400, "bad_header", f"Content-Length {length_text[:20]!r} is not a byte count")
    length = int(length_text)
    if length > max_body_bytes:
        raise _Refused(413, "body_too_large", f"a {length}-byte body; at most {max_body_bytes} bytes")
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == b"HTTP/1.1" else connection == "keep-alive"
    target = parts[1].decode("latin-1")
    return _Head(parts[0].decode("ascii"), target.partition("?")[0], headers, length, keep_alive)


def _encode(response: Response, keep_alive: bool) -> bytes:
    try:
        reason = HTTPStatus(response.status).phrase
    except ValueError:
        reason = ""
    head = [f"HTTP/1.1 {response.status} {reason}", f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}"]
    head += [f"{k}: {v}" for k, v in response.headers]
    if not keep_alive:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body


class _Connection(asyncio.Protocol):
    """One client connection: parses requests out of the byte stream and answers them in order."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._head: _Head | None = None  # parsed, body not complete yet
        self._continued = False
        self._task: asyncio.Task | None = None  # the handler of the request being answered
        self._paused = False
        self.closing = False  # answer the request in hand, then close

    @property
    def busy(self) -> bool:
        return self._task is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._next()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _next(self) -> None:
        """Start answering the next complete request in the buffer, unless one is being answered."""
        if self._task is not None or self._transport is None:
            return
        try:
            if self._head is None:
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self._buffer) > self._server.max_head_bytes:
                        raise _Refused(431, "head_too_large", f"request head over {self._server.max_head_bytes} bytes")
                    return
                self._head = _parse_head(bytes(self._buffer[:end]), self._server.max_body_bytes)
                del self._buffer[:end + 4]
                self._continued = False
        except _Refused as refused:
            self._finish(refused.response, keep_alive=False)
            return
        head = self._head
        if len(self._buffer) < head.body_length:
            if not self._continued and head.headers.get("expect", "").lower() == "100-continue":
                self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self._continued = True
            return
        body = bytes(self._buffer[:head.body_length])
        del self._buffer[:head.body_length]
        self._head = None
        handler, tail, answer = self._server.routes.resolve(head.method, head.path)
        if answer is not None:
            self._finish(answer, head.keep_alive)
            return
        request = Request(head.method, head.path, head.headers, body, tail)
        self._task = asyncio.get_running_loop().create_task(self._answer(handler, request, head.keep_alive))
        if len(self._buffer) > self._server.max_head_bytes + self._server.max_body_bytes:
            self._transport.pause_reading()  # a client pipelining faster than we answer
            self._paused = True

    async def _answer(self, handler: Handler, request: Request, keep_alive: bool) -> None:
        try:
            response = await handler(request)
        except Exception as err:  # the handler's bug must not take the connection or the server down
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(500, "internal_error", f"{type(err).__name__}: {err}")
        self._task = None
        self._finish(response, keep_alive)

    def _finish(self, response: Response, keep_alive: bool) -> None:
        if self._transport is None:
            return
        keep_alive = keep_alive and not self.closing
        self._transport.write(_encode(response, keep_alive))
        if not keep_alive:
            self._transport.close()
            self._transport = None
            return
        if self._paused:
            self._transport.resume_reading()
            self._paused = False
        self._next()

    async def wait_answered(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)


class HttpServer:
    def __init__(self, routes: Routes, max_body_bytes: int = 1 << 20, max_head_bytes: int = 16 << 10) -> None:
        self.routes = routes
        self.max_body_bytes = max_body_bytes
        self.max_head_bytes = max_head_bytes
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The port listened on (the one the OS chose for port 0)."""
        return self._server.sockets[0].getsockname()[1]

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True)

    async def stop(self, timeout_s: float) -> None:
        """Stop listening; let the requests being answered finish (at most `timeout_s`); close every connection."""
        if self._server is None:
            return
        self._server.close()
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
