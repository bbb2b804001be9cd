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
