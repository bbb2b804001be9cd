"""Throwaway redis-server processes for tests and benchmarks.

    from redis_server import redis_server            # fixture: a session server's URL
    def test_x(redis_server): RedisHostStorage(redis_server, ...)

    with RedisServer(tmp_dir) as server:              # a private server a test may stop
        ...; server.stop()

Each server listens on 127.0.0.1 only, on a free port, persists nothing (`--save ''`,
`--appendonly no`) and is stopped by its owner. Tests skip, saying why, when `redis-server`
is not installed (CI installs it with apt). Tests share the session server: give each test
its own namespace (`unique_namespace`) instead of flushing.
"""
from __future__ import annotations

import itertools
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import redis

REDIS_SERVER = "redis-server"
_NAMESPACES = itertools.count()


def redis_server_binary() -> str:
    """Path of redis-server, or skip the calling test."""
    path = shutil.which(REDIS_SERVER)
    if path is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server); skipping the Redis-tier tests")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on a free loopback port, its files in `workdir`."""

    def __init__(self, workdir: Path, binary: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.workdir = Path(workdir)
        self.binary = binary or shutil.which(REDIS_SERVER) or REDIS_SERVER
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> "RedisServer":
        """Start on a free port; retries with another port if one was taken in between (others share the host)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        for _ in range(3):
            self.port = _free_port()
            self._proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.workdir), "--logfile", str(log)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if self._wait_for_ping():
                return self
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {log}:\n{log.read_text()[-2000:] if log.exists() else ''}")

    def _wait_for_ping(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while time.monotonic() < deadline and self.running:
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """Terminate the server (no save) and wait for it."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5.0)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def unique_namespace(prefix: str = "test") -> str:
    """A namespace no other test of this process uses (tests share the session server)."""
    return f"{prefix}-{next(_NAMESPACES)}-{time.time_ns()}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (`redis://127.0.0.1:PORT/0`) of a redis-server shared by the session; skips if none is installed."""
    binary = redis_server_binary()
    with RedisServer(tmp_path_factory.mktemp("redis"), binary) as server:
        yield server.url


@pytest.fixture
def private_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may stop (stopped at teardown in any case)."""
    binary = redis_server_binary()
    with RedisServer(tmp_path / "redis", binary) as server:
        yield server
