"""pytest fixtures shared by every test package (plain helpers live in helpers.py).

Redis: `redis_server` is the URL of one throwaway redis-server for the whole session (tests
share it and isolate themselves with `helpers.unique_namespace()`); `private_redis_server`
is a server of the test's own, which it may stop. Both listen on 127.0.0.1 only, on a free
port, persist nothing, and are stopped at teardown. `durable_redis_server` is a shared one that
fsyncs every write to its AOF (what the Redis history store requires); `make_redis_server(...)`
starts servers of the test's own with other settings. Without `redis-server` installed the
tests that ask for one are skipped, and the run says so once at the end.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU tensors. Set before anything imports
    # triton: it decides at import and decoration time whether it compiles or interprets.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kvcache.local_redis import LocalRedisServer, redis_server_binary

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Every device this machine has: a test taking it runs once per device (cpu, and cuda when present)."""
    return request.param


REDIS_MISSING = "redis-server is not installed (apt-get install redis-server): Redis-tier tests are skipped"


def _require_redis_server() -> str:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip(REDIS_MISSING)
    return binary


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (`redis://127.0.0.1:PORT/0`) of a redis-server shared by the session."""
    with LocalRedisServer(tmp_path_factory.mktemp("redis"), _require_redis_server()) as server:
        yield server.url


@pytest.fixture(scope="session")
def durable_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server shared by the session, run with `appendonly yes`, `appendfsync always`."""
    with LocalRedisServer(tmp_path_factory.mktemp("redis-aof"), _require_redis_server(), durable=True) as server:
        yield server.url


@pytest.fixture
def private_redis_server(tmp_path: Path) -> Iterator[LocalRedisServer]:
    """A redis-server of the test's own, which it may stop (stopped at teardown in any case)."""
    with LocalRedisServer(tmp_path / "redis", _require_redis_server()) as server:
        yield server


@pytest.fixture
def make_redis_server(tmp_path: Path) -> Iterator[Callable[..., LocalRedisServer]]:
    """`make_redis_server(durable=True, extra_args=[...])`: a started server of the test's own (in a
    directory of its own), with `LocalRedisServer`'s options; every one is stopped at teardown."""
    binary = _require_redis_server()
    servers: list[LocalRedisServer] = []

    def make(**options: Any) -> LocalRedisServer:
        server = LocalRedisServer(tmp_path / f"redis-{len(servers)}", binary, **options)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = terminalreporter.stats.get("skipped", [])
    redis_skips = sum(1 for report in skipped if REDIS_MISSING in str(report.longrepr))
    if redis_skips:
        terminalreporter.write_line(f"NOTE: {redis_skips} Redis-tier tests skipped: {REDIS_MISSING}", yellow=True, bold=True)
