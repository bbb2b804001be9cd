"""Users in recency order with their byte sizes: the bookkeeping every size-bounded tier shares.

The memory and disk tiers both keep one entry per user, bound the bytes of all entries, evict
the least recently used user that the caller does not protect, and refuse a user that does not
fit beside the protected ones. This holds that order and that sum; what an entry is and what
dropping one means (a buffer released, files unlinked) stays with the tier.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator
from typing import Generic, Protocol, TypeVar

from .base import HostEntry, HostKVStorage, check_write


class _HasInfo(Protocol):
    @property
    def info(self) -> HostEntry: ...


E = TypeVar("E", bound=_HasInfo)


class BytesLRU(Generic[E]):
    """user -> entry, least recently used first, and the bytes the entries occupy."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, tuple[E, int]] = OrderedDict()
        self._bytes = 0

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, user_id: int) -> bool:
        return user_id in self._entries

    def __iter__(self) -> Iterator[int]:
        """Users, least recently used first."""
        return iter(self._entries)

    def get(self, user_id: int) -> E | None:
        held = self._entries.get(user_id)
        return None if held is None else held[0]

    def nbytes(self, user_id: int) -> int:
        held = self._entries.get(user_id)
        return 0 if held is None else held[1]

    def put(self, user_id: int, entry: E, nbytes: int) -> None:
        """Store (or replace) the user's entry as the most recently used, occupying `nbytes`."""
        self._bytes += nbytes - self.nbytes(user_id)
        self._entries[user_id] = (entry, nbytes)
        self._entries.move_to_end(user_id)

    def touch(self, user_id: int) -> None:
        self._entries.move_to_end(user_id)

    def pop(self, user_id: int) -> E | None:
        held = self._entries.pop(user_id, None)
        if held is None:
            return None
        self._bytes -= held[1]
        return held[0]

    def protected_bytes(self, protect: Collection[int], writer: int) -> int:
        """Bytes of the protected users other than `writer`: what a write of `writer` can never reclaim."""
        return sum(self.nbytes(u) for u in set(protect) if u != writer)

    def victim(self, keep: Collection[int]) -> int | None:
        """The least recently used user not in `keep`; None when every user is kept."""
        return next((u for u in self._entries if u not in keep), None)


class BytesBoundedTier(HostKVStorage):
    """A tier keeping one entry per user in a `BytesLRU`, bounded by `capacity_bytes`: the gauges and
    `info` of such a tier. An entry describes itself with `.info`."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}.")
        self._capacity = int(capacity_bytes)
        self._users: BytesLRU = BytesLRU()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def bytes_used(self) -> int:
        return self._users.bytes_used

    @property
    def num_users(self) -> int:
        return len(self._users)

    def info(self, user_id: int) -> HostEntry | None:
        e = self._users.get(user_id)
        return None if e is None else e.info

    def _checked_write(self, user_id: int, start_pos: int, length: int, first_page: int) -> tuple[E | None, int]:
        """The user's entry and the written entry's page count, once the write is valid (`check_write`)."""
        old = self._users.get(user_id)
        return old, check_write(self.layout, user_id, start_pos, length, first_page, None if old is None else old.info)
