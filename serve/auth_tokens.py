"""Bearer tokens read from files (a Kubernetes Secret mounted as files), taken again when a file changes.

Two files, two formats:

    # clients.tokens: the router's clients, one line each: NAME SCOPES TOKEN
    checkout-svc   score          3f9c...        # may call /score
    event-logger   events         a81b...        # may post /events
    backfill       score,events   77d0...
    # (the same NAME on two lines with two tokens: both accepted, for a rotation without a gap)

    # node.token: what routers send to nodes, the first line's; a node accepts any line's
    5e02...

Scopes: `score` (POST /score, GET /route/...) and `events` (POST /events, and the inline events of a
/score). A file is re-read when its (mtime, size, inode) changes: one stat per check, and a Secret
update (Kubernetes swaps a symlink) or an edit in place is taken without a restart. A file that
becomes unreadable or malformed keeps the last good tokens (and logs why); one that is unreadable
or holds no token at start is refused then.
"""
from __future__ import annotations

import hmac
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("serve.auth")
SCOPES = ("score", "events")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_TOKEN = re.compile(r"^[\x21-\x7e]{16,512}$")  # printable ASCII, no spaces: what a header can carry


class TokenFileError(ValueError):
    """A token file that cannot be used: the message names the file, the line and the problem."""


@dataclass(frozen=True)
class Client:
    name: str
    scopes: frozenset[str]


class _WatchedFile:
    """A file parsed again when its stat signature changes; the last good parse otherwise."""

    def __init__(self, path: str | Path, parse) -> None:
        self.path = Path(path)
        self._parse = parse
        self._lock = threading.Lock()
        self._signature = None
        self.value = self._load(self._stat())  # raises at start: a node must not serve without its tokens

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError as err:
            raise TokenFileError(f"token file {self.path}: {err.strerror}") from None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self, signature: tuple[int, int, int]):
        try:
            text = self.path.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as err:
            raise TokenFileError(f"token file {self.path}: {err}") from None
        value = self._parse(text, self.path)
        self._signature = signature
        return value

    def current(self):
        try:
            signature = self._stat()
            if signature != self._signature:
                with self._lock:
                    if signature != self._signature:
                        self.value = self._load(signature)
                        log.info("token file %s reloaded", self.path)
        except TokenFileError as err:
            log.warning("%s; keeping the tokens read before", err)
        return self.value


def _lines(text: str, path: Path) -> list[tuple[int, list[str]]]:
    out = [(n, line.split("#", 1)[0].split()) for n, line in enumerate(text.splitlines(), 1)]
    out = [(n, fields) for n, fields in out if fields]
    if not out:
        raise TokenFileError(f"token file {path}: no token in it")
    return out


def _check_token(token: str, path: Path, n: int) -> bytes:
    if not _TOKEN.match(token):
        raise TokenFileError(f"token file {path}, line {n}: a token is 16 to 512 printable ASCII characters")
    return token.encode("ascii")


def parse_client_tokens(text: str, path: Path) -> list[tuple[bytes, Client]]:
    entries = []
    for n, fields in _lines(text, path):
        if len(fields) != 3:
            raise TokenFileError(f"token file {path}, line {n}: expected NAME SCOPES TOKEN, got {len(fields)} fields")
        name, scopes, token = fields
        if not _NAME.match(name):
            raise TokenFileError(f"token file {path}, line {n}: a client name is 1 to 64 of [A-Za-z0-9._-]")
        wanted = frozenset(scopes.split(","))
        if not wanted <= set(SCOPES):
            raise TokenFileError(f"token file {path}, line {n}: unknown scope(s) {sorted(wanted - set(SCOPES))}; "
                                 f"scopes are {list(SCOPES)}")
        entries.append((_check_token(token, path, n), Client(name, wanted)))
    return entries


def parse_node_tokens(text: str, path: Path) -> list[bytes]:
    tokens = []
    for n, fields in _lines(text, path):
        if len(fields) != 1:
            raise TokenFileError(f"token file {path}, line {n}: expected one token a line")
        tokens.append(_check_token(fields[0], path, n))
    return tokens


def _find(presented: bytes, tokens: list[bytes]) -> int | None:
    """The index of `presented` among `tokens`, comparing with every one in constant time (no early exit)."""
    found = None
    for i, token in enumerate(tokens):
        if hmac.compare_digest(presented, token) and found is None:
            found = i
    return found


class ClientTokens:
    """The router's clients: a presented token -> its `Client` (None: unknown)."""

    def __init__(self, path: str | Path) -> None:
        self._file = _WatchedFile(path, parse_client_tokens)

    def client(self, presented: bytes) -> Client | None:
        entries = self._file.current()
        i = _find(presented, [token for token, _ in entries])
        return None if i is None else entries[i][1]


class NodeTokens:
    """The routers' token: what a router sends (`token`), what a node accepts (`accepts`)."""

    def __init__(self, path: str | Path) -> None:
        self._file = _WatchedFile(path, parse_node_tokens)

    @property
    def token(self) -> bytes:
        return self._file.current()[0]

    def accepts(self, presented: bytes) -> bool:
        return _find(presented, self._file.current()) is not None
