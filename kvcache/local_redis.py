"""A private redis-server process on loopback, for tests, benchmarks and demos of the Redis tier.

    with LocalRedisServer(workdir) as server:   # 127.0.0.1, a free port, persists nothing
        RedisHostStorage(server.url, ...)

Production nodes point `RedisHostStorage` at a Redis they share; this only exists so that
the tier can be exercised on one machine without one.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = "redis-server"


def redis_server_binary() -> str | None:
    """Path of the redis-server executable, or None when it is not installed."""
    return shutil.which(REDIS_SERVER)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedisServer:
    """One redis-server on 127.0.0.1 and a free port, files (log) in `workdir`; `stop()` ends it.

    Started with `--save '' --appendonly no`: nothing is persisted, a stopped server loses all.
    """

    def __init__(self, workdir: Path | str, binary: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.workdir = Path(workdir).resolve()  # redis-server resolves --logfile after chdir to --dir
        self.binary = binary or redis_server_binary() or REDIS_SERVER
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalRedisServer:
        """Start and wait until PING answers; retries with another port if one was taken in between
        (other processes share the machine)."""
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
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start; {log}:\n{tail}")

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
        """Terminate the server (nothing is saved) and wait for it to exit."""
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

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
