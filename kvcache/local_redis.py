"""A private redis-server process on loopback, for tests, benchmarks and demos of the Redis tier
and the Redis history store.

    with LocalRedisServer(workdir) as server:   # 127.0.0.1, a free port, persists nothing
        RedisHostStorage(server.url, ...)

    server = LocalRedisServer(workdir, durable=True).start()   # AOF in workdir, fsynced per write
    server.kill()      # SIGKILL, as a crash would
    server.restart()   # same port, same files: what was acknowledged is back

Production nodes point `RedisHostStorage` at a Redis they share; this only exists so that
the tier can be exercised on one machine without one.
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
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
    """One redis-server on 127.0.0.1 and a free port, files (log, AOF) in `workdir`; `stop()` ends it.

    Started with `--save ''` and, by default, `--appendonly no`: nothing is persisted, a stopped
    server loses all. `durable=True` runs it with `--appendonly yes --appendfsync always` (each
    write is fsynced to the AOF before the reply), so `restart()` after `kill()` brings back every
    acknowledged write. `extra_args` are passed last (they override the settings above).
    """

    def __init__(self, workdir: Path | str, binary: str | None = None, start_timeout_s: float = 10.0,
                 durable: bool = False, extra_args: Sequence[str] = ()) -> None:
        self.workdir = Path(workdir).resolve()  # redis-server resolves --logfile after chdir to --dir
        self.binary = binary or redis_server_binary() or REDIS_SERVER
        self.start_timeout_s = start_timeout_s
        self.persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
        self.extra_args = list(extra_args)
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
        for _ in range(3):
            if self._launch(_free_port()):
                return self
        raise RuntimeError(f"redis-server did not start; {self._log_tail()}")

    def restart(self) -> LocalRedisServer:
        """Start again on the same port with the same files (after `kill()` or `stop()`): clients
        keep their URL, and a durable server loads its AOF."""
        self.stop()
        if not self._launch(self.port):
            raise RuntimeError(f"redis-server did not restart on port {self.port}; {self._log_tail()}")
        return self

    def _launch(self, port: int) -> bool:
        self.port = port
        self._proc = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *self.persistence,
             "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        if self._wait_for_ping():
            return True
        self.stop()
        return False

    def _log_tail(self) -> str:
        log = self.workdir / "redis.log"
        return f"{log}:\n{log.read_text()[-2000:]}" if log.exists() else f"no {log}"

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
        proc.send_signal(signal.SIGCONT)  # a paused server handles no SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would: no shutdown, no final save or fsync."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP the server, as a stall would (a long fsync, a swapped-out host): connections stay
        open and what clients send waits in the socket until `resume()`."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5.0)

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
