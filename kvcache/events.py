"""Cache events: where a manager holds each user's K/V, for whoever routes users to nodes.

A serving node publishes these to a cluster-wide locality index (serve/), so that a router can
send a returning user to the node that already holds its pages. The manager reports the *best*
place it holds a user after every change: on its device (after a commit or an onload), in its
host tier (after a device eviction the host tier survived), or nowhere (evicted from every tier
this node owns, or invalidated). A shared tier (Redis) is not the node's: it is the fallback of
every node and needs no event.

Events of one manager call are delivered together, in order, with the manager lock held: a
listener must only enqueue (never block, never raise into the cache).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

log = logging.getLogger(__name__)


class CacheLocation(str, Enum):
    DEVICE = "device"
    HOST = "host"
    NONE = "none"


class CacheEvent(NamedTuple):
    user_id: int
    location: CacheLocation
    start_pos: int  # first cached token position (0 with NONE)
    length: int  # cached tokens there (0 with NONE)


CacheEventListener = Callable[[list[CacheEvent]], None]


class CacheEvents:
    """The manager's outbox: collects a call's events, hands them to the listener in one list."""

    def __init__(self, listener: CacheEventListener | None) -> None:
        self._listener = listener
        self._pending: list[CacheEvent] = []

    def on_device(self, user_id: int, start_pos: int, length: int) -> None:
        if self._listener is not None:
            self._pending.append(CacheEvent(user_id, CacheLocation.DEVICE, start_pos, length))

    def on_host(self, user_id: int, start_pos: int, length: int) -> None:
        if self._listener is not None:
            self._pending.append(CacheEvent(user_id, CacheLocation.HOST, start_pos, length))

    def gone(self, user_id: int) -> None:
        if self._listener is not None:
            self._pending.append(CacheEvent(user_id, CacheLocation.NONE, 0, 0))

    def flush(self) -> None:
        if not self._pending:
            return
        events, self._pending = self._pending, []
        try:
            self._listener(events)
        except Exception:  # a broken listener must not break serving; it loses these events
            log.exception("cache event listener failed; %d events dropped", len(events))
