"""The router front's request, response and route table: what handlers see, independent of the parser.

    routes = Routes()
    routes.add("GET", "/health", health)           # async def health(req: Request) -> Response
    routes.add_prefix("GET", "/route/", route)     # req.path_tail: what follows the prefix
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from http import HTTPStatus


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

    def encode(self, keep_alive: bool) -> bytes:
        """The answer on the wire (HTTP/1.1, a Content-Length body)."""
        try:
            reason = HTTPStatus(self.status).phrase
        except ValueError:
            reason = ""
        head = [f"HTTP/1.1 {self.status} {reason}", f"Content-Type: {self.content_type}",
                f"Content-Length: {len(self.body)}"]
        head += [f"{k}: {v}" for k, v in self.headers]
        if not keep_alive:
            head.append("Connection: close")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body


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
            return None, "", error_response(404, "not_found", f"no route for {path[:200]}")
        if method not in by_method:
            allowed = ", ".join(sorted(by_method))
            refusal = error_response(405, "method_not_allowed", f"{method} {path[:200]}: allowed {allowed}")
            return None, "", replace(refusal, headers=(("Allow", allowed),))
        return by_method[method], tail, None
