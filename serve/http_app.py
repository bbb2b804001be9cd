"""Run a server until SIGTERM or SIGINT: the shared lifecycle of node (aiohttp) and router (serve/http_server.py)."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web


async def run_until_signal(start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]],
                           on_ready: Callable[[], None] = lambda: None,
                           on_stop: Callable[[], None] = lambda: None) -> None:
    """`start()`, call `on_ready`, wait for SIGTERM / SIGINT, call `on_stop`, then `stop()` (also when
    `start` or the wait fails)."""
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await start()
        on_ready()
        await stopped.wait()
        on_stop()
    finally:
        await stop()


async def serve_until_signal(app: web.Application, host: str, port: int, shutdown_timeout: float,
                             on_ready: Callable[[], None] = lambda: None,
                             on_stop: Callable[[], None] = lambda: None) -> None:
    """Listen with an aiohttp `app` on host:port until a signal; its shutdown hooks run at the end and
    requests in flight get at most `shutdown_timeout` s."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await run_until_signal(lambda: web.TCPSite(runner, host, port).start(), runner.cleanup, on_ready, on_stop)
