"""Users' logged events, the source of truth that served K/V are derived from (history/base.py)."""
from history.base import AppendResult, BatchConflictError, HistoryStore, HistoryUnavailableError
from history.events import EventBatch, EventError
from history.registry import open_history_store

__all__ = ["AppendResult", "BatchConflictError", "EventBatch", "EventError", "HistoryStore",
           "HistoryUnavailableError", "open_history_store"]
