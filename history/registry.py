"""Open a history store from a URL: the one switch between the embedded and the shared store.

    open_history_store("sqlite:///var/lib/hstu/history.sqlite")   # embedded (a bare path works too)
    open_history_store("redis://10.0.0.5:6379/2")                  # shared by every node
"""
from __future__ import annotations

from history.base import HistoryStore


def open_history_store(url: str) -> HistoryStore:
    if url.startswith(("redis://", "rediss://", "unix://")):
        from history.redis_store import RedisHistoryStore

        return RedisHistoryStore.from_url(url)
    if url.startswith("sqlite://"):
        url = url[len("sqlite://"):]
    if not url:
        raise ValueError("a history store URL needs a path: sqlite:///path/to/history.sqlite")
    from history.sqlite_store import SQLiteHistoryStore

    return SQLiteHistoryStore(url)
