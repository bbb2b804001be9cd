"""Users' logged events, the source of truth that served K/V are derived from (history/base.py).

Exports resolve lazily (PEP 562): the router parses events (history.events, numpy only) and must not
pay for the store's imports, which reach torch through data.user_histories.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "AppendOutcomeUnknownError": "history.base",
    "AppendResult": "history.base",
    "BatchConflictError": "history.base",
    "HistoryStore": "history.base",
    "HistoryUnavailableError": "history.base",
    "EventBatch": "history.events",
    "EventError": "history.events",
    "open_history_store": "history.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'history' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
