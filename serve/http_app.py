"""Run a server until SIGTERM or SIGINT: the shared lifecycle of node and router (both on serve/http_server.py)."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


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

