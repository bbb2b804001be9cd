"""How the router's front refuses a request: the exception its parser callbacks raise, and llhttp's
errors named as the front's documented codes (serve/http_server.py lists them)."""
from __future__ import annotations

import httptools

from serve.http_routes import error_response


class Refused(Exception):
    """A request the server answers itself and then closes the connection for."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.response = error_response(status, code, message)


def content_length(value: str, limit: int) -> int:
    """A Content-Length that llhttp accepted (digits, no overflow past 2^64), as a byte count; Refused
    413 past `limit`. Leading zeros are legal, and Python's int() refuses over 4,300 digits: the
    digits are counted before any conversion."""
    digits = value.strip().lstrip("0") or "0"
    if len(digits) > len(str(limit)) or int(digits) > limit:
        raise Refused(413, "body_too_large", f"a {digits[:20]}{'...' if len(digits) > 20 else ''}-byte body; "
                                             f"at most {limit} bytes")
    return int(digits)


def parser_error_code(err: Exception, headers_done: bool) -> str:
    """llhttp's error, as one of the front's documented codes."""
    if isinstance(err, (httptools.HttpParserInvalidMethodError, httptools.HttpParserInvalidURLError)):
        return "bad_request_line"
    text = str(err).lower()
    if headers_done:
        return "bad_body"
    if any(word in text for word in ("method", "url", "version", "http/")):
        return "bad_request_line"
    return "bad_header"
