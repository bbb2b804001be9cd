"""The request bodies the router's front holds at once, across all its connections.

Per-connection flow control (serve/http_connection.py) bounds what one client makes the router
hold; it does not bound the sum: 50 clients each sending a 1 MiB body hold 50 MiB. A `BodyBudget`
bounds the sum. A request is admitted when its head is complete, with its Content-Length
reserved; a request that does not fit waits, its connection not read, until answered requests
release enough (first come, first admitted). Its reservation is released when its answer is
written, or when its connection goes away.

An admitted request's body always arrives (nothing the budget does can stop it), and an answered
one always releases, so admission cannot deadlock: at worst one request at a time is admitted,
even one larger than the budget (`held == 0` admits anything).

    budget = BodyBudget(limit_bytes=16 << 20)
    if not budget.reserve(connection, length):   # False: `connection.admitted(length)` comes later
        connection.pause_reading()
    ...
    budget.release(length)                        # the answer went out
"""
from __future__ import annotations

from typing import Protocol


class Waiter(Protocol):
    def admitted(self, nbytes: int) -> None:
        """The waiting request's `nbytes` are now reserved: read its body."""


class BodyBudget:
    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.held_bytes = 0  # reserved by admitted requests, not yet released
        self.peak_bytes = 0
        self.waits = 0  # requests that had to wait for admission
        self._waiting: dict[Waiter, int] = {}  # insertion order is arrival order

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def reserve(self, waiter: Waiter, nbytes: int) -> bool:
        """Admit a request of `nbytes` now (True), or queue it (False) until `waiter.admitted(nbytes)`."""
        if waiter in self._waiting:
            raise ValueError("a connection waits for one request at a time")
        if not self._waiting and self._fits(nbytes):  # no overtaking the requests already waiting
            self._hold(nbytes)
            return True
        self._waiting[waiter] = nbytes
        self.waits += 1
        return False

    def take_waiting(self, waiter: Waiter) -> int:
        """Reserve a waiting request's bytes now, over the limit if need be: its body arrived in the
        read that carried its head, so the bytes are held already. -> the bytes reserved (0 if it
        was not waiting)."""
        nbytes = self._waiting.pop(waiter, None)
        if nbytes is None:
            return 0
        self._hold(nbytes)
        return nbytes

    def withdraw(self, waiter: Waiter) -> None:
        """A waiting request's connection went away."""
        if self._waiting.pop(waiter, None) is not None:
            self._admit_waiting()

    def release(self, nbytes: int) -> None:
        if nbytes < 0 or nbytes > self.held_bytes:
            raise ValueError(f"releasing {nbytes} bytes of {self.held_bytes} held")
        self.held_bytes -= nbytes
        self._admit_waiting()

    def _fits(self, nbytes: int) -> bool:
        return self.held_bytes == 0 or self.held_bytes + nbytes <= self.limit_bytes

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _admit_waiting(self) -> None:
        while self._waiting:
            waiter, nbytes = next(iter(self._waiting.items()))
            if not self._fits(nbytes):
                return
            del self._waiting[waiter]
            self._hold(nbytes)
            waiter.admitted(nbytes)
