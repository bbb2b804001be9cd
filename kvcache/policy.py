"""Eviction policies over the users resident on the device.

A policy only orders users; the manager decides how many to evict and skips users it must
keep (the batch being prepared, users with a prepare in flight). Every operation is O(1)
except `order`, which yields lazily, so the cost of choosing victims does not grow with the
number of users known.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator


class EvictionPolicy(ABC):
    @abstractmethod
    def add(self, user_id: int) -> None:
        """A user became resident."""

    @abstractmethod
    def touch(self, user_id: int) -> None:
        """A resident user was used (prepared)."""

    @abstractmethod
    def remove(self, user_id: int) -> None:
        """A user left the device."""

    @abstractmethod
    def order(self) -> Iterator[int]:
        """Resident users, first to evict first. Do not mutate the policy while iterating."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used user first."""

    def __init__(self) -> None:
        self._users: OrderedDict[int, None] = OrderedDict()

    def add(self, user_id: int) -> None:
        self._users[user_id] = None

    def touch(self, user_id: int) -> None:
        self._users.move_to_end(user_id)

    def remove(self, user_id: int) -> None:
        del self._users[user_id]

    def order(self) -> Iterator[int]:
        return iter(self._users)

    def __len__(self) -> int:
        return len(self._users)


class LFUPolicy(EvictionPolicy):
    """Least frequently used (visits while resident) first; least recently used among equals."""

    def __init__(self) -> None:
        self._freq: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}  # frequency -> users, LRU first

    def add(self, user_id: int) -> None:
        self._freq[user_id] = 1
        self._buckets.setdefault(1, OrderedDict())[user_id] = None

    def touch(self, user_id: int) -> None:
        f = self._freq[user_id]
        self._unlink(user_id, f)
        self._freq[user_id] = f + 1
        self._buckets.setdefault(f + 1, OrderedDict())[user_id] = None

    def remove(self, user_id: int) -> None:
        self._unlink(user_id, self._freq.pop(user_id))

    def order(self) -> Iterator[int]:
        for f in sorted(self._buckets):
            yield from self._buckets[f]

    def __len__(self) -> int:
        return len(self._freq)

    def _unlink(self, user_id: int, f: int) -> None:
        bucket = self._buckets[f]
        del bucket[user_id]
        if not bucket:
            del self._buckets[f]


def make_policy(name: str) -> EvictionPolicy:
    policies = {"lru": LRUPolicy, "lfu": LFUPolicy}
    if name not in policies:
        raise ValueError(f"Unknown eviction policy {name!r}; expected one of {sorted(policies)}.")
    return policies[name]()
