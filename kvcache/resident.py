"""A user's K/V on the device: its committed tokens, their pages and what the host already holds of them.

Its own module: the residency that moves users and the offload planner that reads them both need it.
"""
from __future__ import annotations

from array import array

from .cache_version import FROM_HOST
from .storage import HostEntry


class Resident:
    """A user's committed tokens on the device (plus reserved pages while in flight)."""

    __slots__ = ("generation", "length", "pages", "start_pos", "synced", "tag", "zeroed_end")

    def __init__(self, start_pos: int, length: int, pages: array, tag: bytes = b"", synced: HostEntry | None = None):
        self.start_pos = start_pos
        self.length = length
        self.pages = pages
        self.tag = tag  # the caller's fingerprint of the committed tokens (travels to the host tiers)
        self.generation = FROM_HOST  # the commit that made these tokens (kvcache.cache_version)
        # The host entry this manager last wrote or onloaded for the user: an offload appends only to
        # that one, never to an entry another writer (node, process) put there meanwhile.
        self.synced = synced
        # With a read window: the host's copy holds zeros for the unread tokens before this one
        # (bookkeeping of what rewrites pay, kvcache/read_window.py; values never depend on it).
        self.zeroed_end = 0
