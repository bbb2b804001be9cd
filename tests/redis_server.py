"""pytest fixtures running a throwaway redis-server (see `kvcache.local_redis`).

    from redis_server import redis_server             # fixture: a session server's URL
    def test_x(redis_server): RedisHostStorage(redis_server, unique_namespace(), ...)

    def test_y(private_redis_server): ...; private_redis_server.stop()   # a server the test may stop
    server = RedisServer(tmp_path)                     # the same, started by hand (stop() it)

Servers listen on 127.0.0.1 only, on a free port, persist nothing, and are stopped at
teardown. Tests skip, saying why, when `redis-server` is not installed (CI installs it with
apt). Tests share the session server: give each its own namespace instead of flushing.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Iterator

import pytest

from kvcache.local_redis import LocalRedisServer, redis_server_binary

_NAMESPACES = itertools.count()


def require_redis_server() -> str:
    """Path of redis-server, or skip the calling test."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server); skipping the Redis-tier tests")
    return binary


def unique_namespace(prefix: str = "test") -> str:
    """A namespace no other test uses (tests share the session server)."""
    return f"{prefix}-{next(_NAMESPACES)}-{time.time_ns()}"


class RedisServer(LocalRedisServer):
    """A redis-server started on construction, or the calling test skipped if none is installed."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir, require_redis_server())
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (`redis://127.0.0.1:PORT/0`) of a redis-server shared by the session."""
    binary = require_redis_server()
    with LocalRedisServer(tmp_path_factory.mktemp("redis"), binary) as server:
        yield server.url


@pytest.fixture
def private_redis_server(tmp_path: Path) -> Iterator[LocalRedisServer]:
    """A redis-server of the test's own, which it may stop (stopped at teardown in any case)."""
    binary = require_redis_server()
    with LocalRedisServer(tmp_path / "redis", binary) as server:
        yield server
