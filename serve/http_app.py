"""Run an aiohttp application until SIGTERM or SIGINT: the shared lifecycle of node and router."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from aiohttp import web


async def serve_until_signal(app: web.Application, host: str, port: int, shutdown_timeout: float,
                             on_ready: Callable[[], None] = lambda: None,
                             on_stop: Callable[[], None] = lambda: None) -> None:
    """Listen on host:port, call `on_ready`, wait for SIGTERM / SIGINT, call `on_stop`, then close
    the app (its shutdown hooks run; requests in flight get at most `shutdown_timeout` s)."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        on_ready()
        await stop.wait()
        on_stop()
    finally:
        await runner.cleanup()
