"""One client connection of the router's front: llhttp (httptools) parses, this class schedules.

The parser is a maintained one (llhttp, the parser under Node.js and uvicorn): it owns the wire
format (request line, header syntax, Content-Length digits and overflow, duplicate lengths, bare
LF, chunked framing). This class owns what a server adds on top, each bounded:

* requests are answered in order, one handler at a time; pipelined requests wait in a queue that
  is drained by a loop, never by recursion;
* flow control: while a request is being answered, reading pauses once the queued requests or
  their bytes pass `ServerLimits.max_pipelined` / `max_buffered_bytes`, and resumes as they drain;
  across connections, a request's body is read only once the server's `BodyBudget` admits it
  (serve/http_budget.py);
* a head over `max_head_bytes` is refused (431) even while it is still arriving, a body over
  `max_body_bytes` as soon as its Content-Length says so (413);
* deadlines: the head, the body and the idle time between requests each have their own
  (`HttpServer` closes a connection past its deadline, with a 408 if a request was begun).

A refusal is answered after the requests before it, with `Connection: close`; nothing after it is
read.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import httptools

from serve.http_budget import BodyBudget
from serve.http_limits import ServerLimits
from serve.http_refusals import Refused, content_length, parser_error_code
from serve.http_routes import Handler, Request, Response, Routes, error_response

log = logging.getLogger("serve.http")


@dataclass(frozen=True)
class _Queued:
    """A parsed request waiting its turn, or an answer decided without a handler (404, a refusal)."""

    request: Request | None
    handler: Handler | None
    answer: Response | None
    keep_alive: bool
    reserved: int  # of the server's body budget, released once answered


class ConnectionOwner(Protocol):
    """What a connection reads of the server that accepted it (`HttpServer`), named here so that the
    connection does not import the server that imports it."""

    routes: Routes
    limits: ServerLimits
    connections: set[Connection]
    body_budget: BodyBudget


class Connection(asyncio.Protocol):
    def __init__(self, server: ConnectionOwner) -> None:
        self._server = server
        self._limits = server.limits
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: deque[_Queued] = deque()
        self._queued_bytes = 0  # bodies waiting in the queue
        self._task: asyncio.Task | None = None  # the handler being awaited
        self._paused = False
        self._awaiting_budget = False  # the request being received waits for the body budget
        self._reserved = 0  # the body budget held for the request being received
        self._refused = False  # a refusal is queued: read nothing more
        self.closing = False  # answer what is in hand, then close
        # the request being parsed
        self._in_message = False
        self._headers_done = False
        self._url = bytearray()
        self._headers: dict[str, str] = {}
        self._head_bytes = 0  # of the complete head lines seen (exact)
        self._head_raw = 0  # received while the head is incomplete (see _count_partial_head)
        self._completed_in_chunk = False
        self._body = bytearray()
        # when this connection is closed unless it makes progress (loop time; None: no deadline); from
        # the accept: a connection the loop never completes is dropped from the count at this deadline
        self.deadline: float | None = None
        self.deadline_reason = ""
        self._set_deadline(self._limits.keep_alive_timeout_s, "idle")

    @property
    def busy(self) -> bool:
        return self._task is not None

    @property
    def reading_paused(self) -> bool:
        return self._paused

    @property
    def buffered_bytes(self) -> int:
        """Request bodies held here: the queued requests' and the one being received."""
        return self._queued_bytes + len(self._body)

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._set_deadline(self._limits.keep_alive_timeout_s, "idle")

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._transport = None
        self.deadline = None
        self._drop_queue()
        self._server.body_budget.withdraw(self)
        self._awaiting_budget = False
        self._release(self._reserved)
        self._reserved = 0

    def data_received(self, data: bytes) -> None:
        if self._refused or self._transport is None:
            return
        head_before = self._in_message and not self._headers_done
        self._completed_in_chunk = False
        try:
            self._parser.feed_data(data)
            if self._in_message and not self._headers_done:
                self._count_partial_head(len(data), head_before)
        except httptools.HttpParserCallbackError as err:
            refusal = err.__context__ if isinstance(err.__context__, Refused) else None
            if refusal is None:
                raise
            self._refuse(refusal)
        except Refused as refusal:
            self._refuse(refusal)
        except httptools.HttpParserUpgrade:
            self._refuse(Refused(400, "upgrade_not_supported", "protocol upgrades are not supported"))
        except httptools.HttpParserError as err:
            code = parser_error_code(err, self._headers_done)
            self._refuse(Refused(400, code, f"malformed request: {err}"))
        self._advance()
        self._flow_control()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ------------------------------------------------------------------ httptools callbacks
    def on_message_begin(self) -> None:
        self._in_message, self._headers_done = True, False
        self._url.clear()
        self._headers = {}
        self._head_bytes = self._head_raw = 0
        self._body = bytearray()
        self._set_deadline(self._limits.header_timeout_s, "head")

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._headers_done = True
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):
            raise Refused(505, "http_version_not_supported", f"HTTP/{version}: this server speaks HTTP/1.0 and 1.1")
        if "transfer-encoding" in self._headers:
            raise Refused(501, "transfer_encoding_not_supported",
                          f"Transfer-Encoding {self._headers['transfer-encoding'][:40]!r} is not supported: "
                          "send a Content-Length body")
        length = content_length(self._headers.get("content-length", "0"), self._limits.max_body_bytes)
        if version == "1.1" and "host" not in self._headers:
            raise Refused(400, "missing_host", "an HTTP/1.1 request must carry a Host header")
        if length and not self._server.body_budget.reserve(self, length):
            self._awaiting_budget = True  # `admitted` resumes it; not the client's time meanwhile
            self.deadline = None
            return
        self._reserved = length
        self._start_body()

    def admitted(self, nbytes: int) -> None:
        """The body budget took this request's bytes (serve/http_budget.py): read its body."""
        self._awaiting_budget, self._reserved = False, nbytes
        if self._transport is not None:
            self._start_body()
            self._flow_control()

    def _start_body(self) -> None:
        if self._headers.get("expect", "").lower() == "100-continue" and self._idle():
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._set_deadline(self._limits.body_timeout_s, "body")

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self._in_message = False
        self._completed_in_chunk = True
        path = self._url.decode("latin-1").partition("?")[0]
        method = self._parser.get_method().decode("ascii")
        keep_alive = self._parser.should_keep_alive()
        handler, tail, answer = self._server.routes.resolve(method, path)
        if self._awaiting_budget:  # the whole body came in the read that carried the head
            self._awaiting_budget = False
            self._reserved = self._server.body_budget.take_waiting(self)
        reserved, self._reserved = self._reserved, 0
        request = None
        if answer is None:  # a request answered without its handler (404, 405) keeps no body
            request = Request(method, path, self._headers, bytes(self._body), tail)
            self._queued_bytes += len(request.body)
        else:
            self._release(reserved)
            reserved = 0
        self._queue.append(_Queued(request, handler, answer, keep_alive, reserved))
        self._body = bytearray()
        self.deadline = None  # answering is the handler's time, bounded by its own timeouts

    # ------------------------------------------------------------------ answering, in order
    def _advance(self) -> None:
        """Answer queued requests in order until one needs its handler awaited (a loop, not recursion)."""
        while self._task is None and self._queue and self._transport is not None:
            item = self._queue.popleft()
            if item.request is None:
                if not self._write(item.answer, item.keep_alive):
                    return
                continue
            self._queued_bytes -= len(item.request.body)
            self._task = asyncio.get_running_loop().create_task(self._answer(item))
            return
        if self._transport is not None and self._idle() and not self._in_message:
            self._set_deadline(self._limits.keep_alive_timeout_s, "idle")

    async def _answer(self, item: _Queued) -> None:
        try:
            response = await item.handler(item.request)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the handler's bug must not take the connection or the server down
            log.exception("%s %s failed", item.request.method, item.request.path)
            response = error_response(500, "internal_error", f"{type(err).__name__}: {err}")
        self._task = None
        self._release(item.reserved)
        if self._transport is not None and self._write(response, item.keep_alive):
            self._advance()
            self._flow_control()

    def _write(self, response: Response, keep_alive: bool) -> bool:
        """Send an answer; -> whether the connection stays open."""
        keep_alive = keep_alive and not self.closing
        self._transport.write(response.encode(keep_alive))
        if not keep_alive:
            self._transport.close()
            self._transport = None
            self._drop_queue()
            self.deadline = None
        return keep_alive

    def _drop_queue(self) -> None:
        self._release(sum(item.reserved for item in self._queue))
        self._queue.clear()
        self._queued_bytes = 0

    def _release(self, nbytes: int) -> None:
        if nbytes:
            self._server.body_budget.release(nbytes)

    def _refuse(self, refusal: Refused) -> None:
        self._refused = True
        self._in_message = False
        self._queue.append(_Queued(None, None, refusal.response, False, 0))

    # ------------------------------------------------------------------ limits
    def _idle(self) -> bool:
        return self._task is None and not self._queue

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self._limits.max_head_bytes:
            raise Refused(431, "head_too_large", f"request head over {self._limits.max_head_bytes} bytes")

    def _count_partial_head(self, chunk: int, began_before: bool) -> None:
        """Bound a head still arriving: llhttp hands over a header line only once it is complete, and
        buffers it without limit until then. The raw bytes received since the head began bound it:
        exactly when the head began with this chunk or before it; when a request ended earlier in
        this chunk the head's share of it is unknown, and the next chunks count (so one read at most
        goes unchecked)."""
        if began_before:
            self._head_raw += chunk
        elif not self._completed_in_chunk:
            self._head_raw = chunk
        if self._head_raw > self._limits.max_head_bytes:
            raise Refused(431, "head_too_large", f"request head over {self._limits.max_head_bytes} bytes")

    def _flow_control(self) -> None:
        if self._transport is None:
            return
        backlog = self._awaiting_budget or (self._task is not None and (
            len(self._queue) >= self._limits.max_pipelined
            or self._queued_bytes + len(self._body) > self._limits.max_buffered_bytes))
        if backlog and not self._paused:
            self._transport.pause_reading()
            self._paused = True
            self.deadline = None  # the client is not late while we do not read: the handler is
        elif not backlog and self._paused:
            self._transport.resume_reading()
            self._paused = False
            if self._in_message:  # the phase's time starts again
                phase = "body" if self._headers_done else "head"
                limit = self._limits.body_timeout_s if self._headers_done else self._limits.header_timeout_s
                self._set_deadline(limit, phase)

    def _set_deadline(self, timeout_s: float, reason: str) -> None:
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.deadline_reason = reason

    def expire(self) -> None:
        """Past the deadline: a begun request hears 408, an idle connection just closes."""
        if self._transport is None:
            self._server.connections.discard(self)  # accepted, never made (or closed): no longer counted
            self.deadline = None
            return
        if self.deadline_reason in ("head", "body") and self._idle():
            limit = self._limits.header_timeout_s if self.deadline_reason == "head" else self._limits.body_timeout_s
            self._transport.write(error_response(
                408, "request_timeout", f"the request's {self.deadline_reason} did not arrive within {limit} s"
            ).encode(keep_alive=False))
        self._transport.close()
        self._transport = None
        self.deadline = None

    async def wait_answered(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)
