"""A node's side of the locality index: its cache events and heartbeat, written by a background thread.

The KV cache hands its events to `listener` under its lock, so the listener only enqueues. The
thread drains the queue, keeps only each user's latest state, and writes the changes in one
MULTI/EXEC; every `heartbeat_s` it refreshes the node's entry and the expiry of its users.

It also keeps the node's whole view (user -> Holding). When Redis was unreachable for a while
(events lost) or the node's entries expired (a pause longer than the TTL), the next successful
write replaces the users hash with that view: the index converges to the node's true state.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import redis

from serve.locality_index import DEVICE, HOST, NODE_TIERS, Holding, LocalityIndexWriter

if TYPE_CHECKING:
    from kvcache import CacheEvent

log = logging.getLogger(__name__)

_STOP = object()


def holding_of(event: CacheEvent) -> Holding | None:
    """The index entry a cache event stands for (None: the node no longer holds the user)."""
    tier = getattr(event.location, "value", event.location)
    if tier not in NODE_TIERS or event.length <= 0:
        return None
    return Holding(tier, int(event.start_pos), int(event.length))


class IndexPublisher:
    def __init__(
        self,
        writer: LocalityIndexWriter,
        heartbeat_s: float,
        node_info: Callable[[], Mapping[str, object]] = dict,
        advertised_url: str = "",
    ) -> None:
        if heartbeat_s <= 0 or heartbeat_s * 1000 >= writer.ttl_ms:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be > 0 and below the TTL ({writer.ttl_ms} ms)")
        self.writer = writer
        self.heartbeat_s = heartbeat_s
        self._node_info = node_info
        self._static_info = {"url": advertised_url, "pid": os.getpid(), "started_ms": int(time.time() * 1000)}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._holdings: dict[int, Holding] = {}  # written by the thread, copied by `holdings`
        self._lock = threading.Lock()
        self._resync = True  # the first write replaces whatever a previous process of this node left
        self._thread: threading.Thread | None = None
        self.failures = 0  # writes that failed (Redis down or slow)

    def listener(self, events: list[CacheEvent]) -> None:
        """The KV cache's event listener: enqueue only (runs under the cache's lock)."""
        self._queue.put(events)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="index-publisher", daemon=True)
        self._thread.start()

    def stop(self, remove: bool = True, timeout_s: float = 5.0) -> None:
        """Write what is queued, stop the thread and (`remove`) delete the node's entries."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        self._thread = None
        if remove:
            try:
                self.writer.remove()
            except redis.RedisError as err:
                log.warning("could not remove this node from the locality index (its entries expire): %s", err)

    @property
    def holdings(self) -> dict[int, Holding]:
        """A copy of the node's view of what it holds (user -> Holding), as last written."""
        with self._lock:
            return dict(self._holdings)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        next_beat = 0.0
        while True:
            timeout = max(0.0, next_beat - time.monotonic())
            changes, stopping = self._drain(timeout)
            with self._lock:
                for u, h in changes.items():
                    if h is None:
                        self._holdings.pop(u, None)
                    else:
                        self._holdings[u] = h
            beat = time.monotonic() >= next_beat
            if self._write(changes, beat):
                next_beat = time.monotonic() + self.heartbeat_s if beat else next_beat
            else:
                next_beat = time.monotonic() + min(self.heartbeat_s, 0.25)  # retry soon
            if stopping:
                return

    def _drain(self, timeout: float) -> tuple[dict[int, Holding | None], bool]:
        """Events queued now (waiting up to `timeout` for the first), latest state per user."""
        changes: dict[int, Holding | None] = {}
        stopping = False
        try:
            item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            while True:
                if item is _STOP:
                    stopping = True
                else:
                    for event in item:
                        changes[int(event.user_id)] = holding_of(event)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        return changes, stopping

    def _write(self, changes: dict[int, Holding | None], beat: bool) -> bool:
        try:
            if self._resync:
                self.writer.replace(self._holdings)
                self._resync = False
            elif changes:
                existed = self.writer.publish(changes)
                if not existed and len(self._holdings) > len([h for h in changes.values() if h is not None]):
                    self._resync = True  # the hash had expired: what it lost must be rewritten
            if beat:
                tiers = [h.tier for h in self._holdings.values()]
                info = {**self._static_info, **self._node_info(),
                        "users_on_device": tiers.count(DEVICE), "users_on_host": tiers.count(HOST)}
                existed = self.writer.heartbeat(info)
                if self._holdings and not existed:
                    self._resync = True
            if self._resync:
                self.writer.replace(self._holdings)
                self._resync = False
            return True
        except redis.RedisError as err:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("locality index write failed (%d so far; resyncing when Redis answers): %s", self.failures, err)
            self._resync = True
            return False
