"""Start the processes of a local cluster on loopback: nodes and routers (the tests, the benchmarks).

    node = start_node(data_dir, checkpoint, log_dir, redis_url=redis.url)
    routers = start_routers(2, [node.address], "kv-aware", log_dir, redis_url=redis.url)
    wait_healthy([node, *routers], timeout_s=120)
    ...
    routers[0].stop(); node.stop()  # SIGTERM, then SIGKILL after the timeout; node.kill() for a crash

    python -m benchmark.harness.launch --data_dir DIR --checkpoint DIR --nodes 2 --routers 2   # until Ctrl-C

Each process logs to a file in `log_dir`; errors quote its tail. Redis comes from
`kvcache.local_redis.LocalRedisServer`. Routers keep no state of their own (their index mirror is
rebuilt from Redis), so any number of them can front the same nodes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One child process serving HTTP on 127.0.0.1:`port`."""

    def __init__(self, name: str, args: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.args = args
        self.port = port
        self.log_path = log_path
        self._env = env
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def restart(self) -> Service:
        """The same command again (same port and node id) after the process ended."""
        if self.alive():
            raise RuntimeError(f"{self.name} is still running")
        return Service(self.name, self.args, self.port, self.log_path, self._env)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a graceful shutdown), SIGKILL if it has not exited after `timeout_s`. -> exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL (a crash) and reap."""
        if self.alive():
            self.proc.kill()
        return self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-chars:]

    def health(self, timeout_s: float = 2.0) -> tuple[int, dict]:
        """(status, body) of GET /health; (0, {}) when it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, _json_or_empty(err.read())
        except (OSError, ValueError):
            return 0, {}


def _json_or_empty(raw: bytes) -> dict:
    try:
        return json.loads(raw)
    except ValueError:
        return {}


def child_env(torch_threads: int = 1) -> dict[str, str]:
    paths = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "OMP_NUM_THREADS": str(torch_threads), "MKL_NUM_THREADS": str(torch_threads)}


def start_node(data_dir: Path | str | None, checkpoint: Path | str, log_dir: Path | str, redis_url: str | None = None,
               port: int | None = None, extra_args: Sequence[str] = (), name: str | None = None,
               history_store: str | None = None) -> Service:
    """A node over `history_store` (a URL: live events) or, when None, over the dataset in `data_dir`."""
    port = port or free_port()
    source = ["--history_store", history_store] if history_store is not None else ["--data_dir", str(data_dir)]
    args = [sys.executable, "-m", "serve.node", *source, "--checkpoint", str(checkpoint),
            "--port", str(port), *(["--redis_url", redis_url] if redis_url else []), *extra_args]
    name = name or f"node-{port}"
    return Service(name, args, port, Path(log_dir) / f"{name}.log", child_env())


def start_router(nodes: Sequence[str], policy: str, log_dir: Path | str, redis_url: str | None = None,
                 port: int | None = None, extra_args: Sequence[str] = ()) -> Service:
    port = port or free_port()
    args = [sys.executable, "-m", "serve.router", "--nodes", ",".join(nodes), "--policy", policy, "--port", str(port),
            *(["--redis_url", redis_url] if redis_url else []), *extra_args]
    return Service(f"router-{policy}-{port}", args, port, Path(log_dir) / f"router-{policy}-{port}.log", child_env())


def start_routers(count: int, nodes: Sequence[str], policy: str, log_dir: Path | str, redis_url: str | None = None,
                  extra_args: Sequence[str] = ()) -> list[Service]:
    """`count` routers over the same nodes, each on a port of its own."""
    if count < 1:
        raise ValueError(f"start_routers needs count >= 1, got {count}")
    return [start_router(nodes, policy, log_dir, redis_url, extra_args=extra_args) for _ in range(count)]


def wait_healthy(services: Sequence[Service], timeout_s: float = 180.0) -> None:
    """Wait until every service answers /health with 200; RuntimeError (with its log) if one exits or
    the time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending:
        for service in list(pending):
            if not service.alive():
                raise RuntimeError(f"{service.name} exited with {service.proc.returncode}:\n{service.log_tail()}")
            if service.health(timeout_s=1.0)[0] == 200:
                pending.remove(service)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"{pending[0].name} not healthy after {timeout_s:.0f} s:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(0.1)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `predicate()` until it is true (-> True) or the time runs out (-> False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def main(argv: list[str] | None = None) -> int:
    """A local cluster until Ctrl-C / SIGTERM: a private redis-server, `--nodes` nodes, `--routers` routers."""
    from kvcache.local_redis import LocalRedisServer

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--data_dir", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--policy", default="kv-aware")
    p.add_argument("--workdir", default="artifacts/local_cluster", help="logs and Redis files")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.routers < 1:
        p.error(f"need --nodes >= 1 and --routers >= 1, got {args.nodes} and {args.routers}")
    workdir = Path(args.workdir)
    redis = LocalRedisServer(workdir / "redis").start()
    services: list[Service] = []
    try:
        services += [start_node(args.data_dir, args.checkpoint, workdir / "logs", redis.url) for _ in range(args.nodes)]
        nodes = [s.address for s in services]
        services += start_routers(args.routers, nodes, args.policy, workdir / "logs", redis.url)
        wait_healthy(services)
        print(f"redis {redis.url}; nodes {', '.join(nodes)}; routers "
              f"{', '.join(s.url for s in services[args.nodes:])}; logs in {workdir / 'logs'}", flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the cluster as Ctrl-C does
        while all(s.alive() for s in services):
            time.sleep(0.5)
        ended = next(s for s in services if not s.alive())
        print(f"{ended.name} exited with {ended.proc.returncode}:\n{ended.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for service in reversed(services):  # routers first: nothing is sent to a node that is stopping
            service.stop()
        redis.stop()


if __name__ == "__main__":
    sys.exit(main())
