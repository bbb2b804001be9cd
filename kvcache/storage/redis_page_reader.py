"""PageReader: the Redis tier's MGET of page keys, read straight into the caller's rows."""
from __future__ import annotations

import numpy as np
import redis


class PageReader:
    """`MGET` whose values land straight in the caller's rows, one copy each.

    redis-py's parser copies every value several times (socket chunks -> BytesIO -> bytes -> slices),
    which for large pages costs more than reading the reply with `recv_into` the destination
    (docs/kvcache-tiers.md). The connection is redis-py's (URL, AUTH, SELECT, TLS, timeouts),
    private to this reader; only its reply is parsed here.
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._conn: redis.Connection | None = None
        self._pending = bytearray()  # bytes received past the header being parsed

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
        self._conn = None
        self._pending.clear()

    def mget_into(self, keys: list[str], rows: list[np.ndarray]) -> list[int]:
        """Each key's value into its row of `rows` (uint8 arrays, one per key) when it is exactly row-sized
        (other values are read and discarded); returns the values' lengths, -1 for a missing key."""
        if self._conn is None:
            self._conn = self._pool.connection_class(**self._pool.connection_kwargs)
        try:
            self._conn.send_command("MGET", *keys)  # connects first if needed
            sock = self._conn._sock  # the reply is read here, not by redis-py's parser
            head = self._line(sock)
            if head.startswith(b"-"):
                raise redis.ResponseError(head[1:].decode(errors="replace"))
            if head != b"*%d" % len(keys):
                raise redis.ConnectionError(f"unexpected reply to MGET: {head[:40]!r}")
            lengths = []
            for row in rows:
                head = self._line(sock)
                if not head.startswith(b"$"):
                    raise redis.ConnectionError(f"unexpected value header in MGET reply: {head[:40]!r}")
                n = int(head[1:])
                lengths.append(n)
                if n >= 0:
                    self._read_into(sock, memoryview(row) if n == len(row) else memoryview(bytearray(n)))
                    self._read_into(sock, memoryview(bytearray(2)))  # the value's CRLF
            return lengths
        except BaseException as exc:
            self.close()  # whatever was left of the reply is garbage now
            if isinstance(exc, TimeoutError):
                raise redis.TimeoutError(f"Timeout reading pages: {exc}") from exc
            if isinstance(exc, OSError):
                raise redis.ConnectionError(f"Error reading pages: {exc}") from exc
            raise

    def _line(self, sock) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            self._recv(sock, 64)  # headers are short: never read far into the next value
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _read_into(self, sock, view: memoryview) -> None:
        done = min(len(self._pending), len(view))
        view[:done] = self._pending[:done]
        del self._pending[:done]
        while done < len(view):
            n = sock.recv_into(view[done:])
            if not n:
                raise ConnectionError("Redis closed the connection")
            done += n

    def _recv(self, sock, n: int) -> None:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("Redis closed the connection")
        self._pending += chunk
