"""EncodedMemoryStorage: the host-RAM tier for a codec other than raw.

Encoded pages differ in size (a lossless codec's by page, a lossy one's from the raw page), so
they cannot live in the raw tier's fixed-size page slab; each user's pages are kept as the encoded
parts its writes made (an incremental write keeps the pages before it and adds one part; past
MAX_PARTS parts they are merged into one), bounded by their bytes, least recently used users
evicted first. A read hands the parts out still encoded: the device pool decodes them straight
into its pages, so an onload writes each value once. The raw codec keeps `InMemoryHostStorage`
(pinned slab, layer-major, no decode).
"""
from __future__ import annotations

from collections.abc import Collection

from ..codecs import EncodedPages
from ..page_data import decoded
from .base import HostEntry, HostPages, HostWriteResult, PageFill
from .lru import BytesBoundedTier
from .tier_codec import TierCodec, whole_fill

MAX_PARTS = 16  # encoded parts an entry keeps before they are merged (bounds the pieces a read decodes)


class _Entry:
    __slots__ = ("length", "parts", "start_pos", "tag")

    def __init__(self, start_pos: int, length: int, tag: bytes, parts: list[EncodedPages]) -> None:
        self.start_pos = start_pos
        self.length = length
        self.tag = tag
        self.parts = parts  # ceil(length / S) encoded pages, in order, each part with its codec's spec

    @property
    def spec(self) -> str:
        """The codec of every part (a write in another codec rewrites the entry whole)."""
        return self.parts[0].spec

    def first_pages(self, n: int) -> list[EncodedPages]:
        """The parts holding pages [0, n), the last one cut at n."""
        kept, start = [], 0
        for part in self.parts:
            if start >= n:
                break
            kept.append(part if start + part.num_pages <= n else part.page_range(0, n - start))
            start += part.num_pages
        return kept

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
        pages = self.codec.deferred(self.layout, e.parts)
        return HostPages(e.start_pos, e.length, pages, e.tag)

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        layout = self.layout
        old, num_pages = self._checked_write(user_id, start_pos, length, first_page)
        if old is not None and first_page and old.spec != self.codec.spec:
            fill, first_page = whole_fill(decoded(self.read(user_id).pages), first_page, fill), 0
        new = self.codec.fill_and_encode(layout, num_pages - first_page, fill, lambda: self.drop(user_id), owned=True)
        parts = (old.first_pages(first_page) if first_page else []) + [new]
        if len(parts) > MAX_PARTS:
            parts = [EncodedPages.from_rows(new.spec, [row for part in parts for row in part.rows()])]
        nbytes = sum(part.nbytes for part in parts)
        if nbytes > self._capacity - self._users.protected_bytes(protect, user_id):
            return HostWriteResult(False, ())
        evicted = []
        keep = {user_id, *protect}
        while self._users.bytes_used - self._users.nbytes(user_id) + nbytes > self._capacity:
            victim = self._users.victim(keep)  # exists: the room was checked above
            evicted.append((victim, self._users.get(victim).info))
            self.drop(victim)
        self._users.put(user_id, _Entry(start_pos, length, bytes(tag), parts), nbytes)
        return HostWriteResult(True, tuple(evicted))

    def drop(self, user_id: int) -> bool:
        return self._users.pop(user_id) is not None

