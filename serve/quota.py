"""Per-client token buckets: how many events a client may write, with bursts.

    quota = EventQuota(events_per_s=500, burst=5000)
    wait_s = quota.take("event-logger", 120)   # 0.0: taken; > 0: refused, retry after that many seconds

Each client's bucket holds up to `burst` events and refills at `events_per_s`. A request takes its
events all at once or none (a refused request takes nothing), so a client over its rate is told
exactly when its batch would fit. Buckets are kept per client name: the names are those of the
token file, a bounded set (or one anonymous bucket when authentication is off).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    level: float
    updated: float


class EventQuota:
    def __init__(self, events_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not events_per_s > 0:
            raise ValueError(f"the events rate must be > 0 a second, got {events_per_s}")
        if burst < 1:
            raise ValueError(f"the events burst must be >= 1, got {burst}")
        self.events_per_s = float(events_per_s)
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, client: str, events: int) -> float:
        """Take `events` from `client`'s bucket -> 0.0, or the seconds until they would fit (nothing taken)."""
        if events > self.burst:
            raise ValueError(f"{events} events at once exceed the burst of {self.burst}")
        now = self._clock()
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = _Bucket(float(self.burst), now)
        bucket.level = min(float(self.burst), bucket.level + (now - bucket.updated) * self.events_per_s)
        bucket.updated = now
        if bucket.level >= events:
            bucket.level -= events
            return 0.0
        return (events - bucket.level) / self.events_per_s


def retry_after_header(wait_s: float) -> str:
    """Retry-After in whole seconds, never 0 (a client told 0 retries at once and is refused again)."""
    return str(max(1, math.ceil(wait_s)))
