"""EncodedMemoryStorage: the host-RAM tier for a codec other than raw.

Encoded pages differ in size (a lossless codec's by page, a lossy one's from the raw page), so
they cannot live in the raw tier's fixed-size page slab; each user's pages are kept as the byte
rows its writes encoded, bounded by their bytes, least recently used users evicted first. A read
decodes the user's pages with one decode over all of them (the codec's tensor ops), into fresh
host memory. The raw codec keeps `InMemoryHostStorage` (pinned slab, layer-major, no decode).
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from ..codecs import EncodedPages
from .base import HostEntry, HostPages, HostWriteResult, PageFill
from .lru import BytesBoundedTier
from .tier_codec import TierCodec, whole_fill


class _Entry:
    __slots__ = ("length", "rows", "spec", "start_pos", "tag")

    def __init__(self, start_pos: int, length: int, tag: bytes, spec: str, rows: list[np.ndarray]) -> None:
        self.start_pos = start_pos
        self.length = length
        self.tag = tag
        self.spec = spec  # the codec that encoded `rows`
        self.rows = rows  # [ceil(length / S)] encoded pages

    @property
    def info(self) -> HostEntry:
        return HostEntry(self.start_pos, self.length, self.tag)


class EncodedMemoryStorage(BytesBoundedTier):
    """Host RAM tier of encoded pages, bounded by `capacity_bytes` of encodings."""

    def __init__(self, capacity_bytes: int, codec: str) -> None:
        super().__init__(capacity_bytes)
        self.codec = TierCodec(codec)

    def read(self, user_id: int) -> HostPages | None:
        e = self._users.get(user_id)
        if e is None:
            return None
        self._users.touch(user_id)
        pages = self.codec.decode(self.layout, EncodedPages.from_rows(e.spec, e.rows))
        return HostPages(e.start_pos, e.length, pages, e.tag)

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        layout = self.layout
        old, num_pages = self._checked_write(user_id, start_pos, length, first_page)
        if old is not None and first_page and old.spec != self.codec.spec:
            fill, first_page = whole_fill(self.read(user_id).pages, first_page, fill), 0
        new_rows = self.codec.fill_and_encode(layout, num_pages - first_page, fill, lambda: self.drop(user_id))
        rows = (old.rows[:first_page] if first_page else []) + [row.copy() for row in new_rows]
        nbytes = sum(len(row) for row in rows)
        if nbytes > self._capacity - self._users.protected_bytes(protect, user_id):
            return HostWriteResult(False, ())
        evicted = []
        keep = {user_id, *protect}
        while self._users.bytes_used - self._users.nbytes(user_id) + nbytes > self._capacity:
            victim = self._users.victim(keep)  # exists: the room was checked above
            evicted.append((victim, self._users.get(victim).info))
            self.drop(victim)
        self._users.put(user_id, _Entry(start_pos, length, bytes(tag), self.codec.spec, rows), nbytes)
        return HostWriteResult(True, tuple(evicted))

    def drop(self, user_id: int) -> bool:
        return self._users.pop(user_id) is not None
