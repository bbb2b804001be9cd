"""DiskHostStorage: a persistent local tier that survives a restart and a crash (kill -9) mid-write.

Directory (one `DiskHostStorage` per directory at a time, held by an `flock` on `lock`):

    layout.json                       the PageLayout of the pages; `bind` refuses another one
    users/{uid % 256:02x}/{uid}.idx   the user's entry: its commit point
    users/{..}/{uid}_{page}_{seq}.kv  one page as written by write number `seq`: its encoding by the
                                      entry's codec (`kvcache.codecs`; raw: the page blob,
                                      kvcache/page_data.py: K/V, then times)

The index file's format is kvcache/storage/disk_format.py's. The entry is read with the codec its
spec names; a write encodes with the tier's codec (`codec`).

A write puts its pages under fresh names (write numbers only grow, so a committed index never
refers to a file being written), then the index to a temporary file that replaces the old one
(`os.replace`, the commit), then unlinks the pages the new index no longer refers to; with
`fsync` each file and the directory are synced before the next step. A crash at any point leaves
the old entry or the new one, plus garbage that `bind` removes: temporary files, indexes that fail
their checksum or refer to a missing or short page file, page files no index refers to. A page
whose bytes fail their checksum at `read` drops the entry (`corrupt_reads`); nothing partial or
corrupted is returned.

Incremental writes cost O(new pages): pages before `first_page` keep their files. Recency is
the index file's mtime (written at each write, touched at each read), so the LRU order survives a
restart approximately; the byte bound survives it exactly (`bind` evicts down to the capacity).
"""
from __future__ import annotations

import errno
import fcntl
import os
import weakref
import zlib
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..codecs import DEFAULT_CODEC, EncodedPages
from ..page_layout import PageLayout
from .base import HostEntry, HostPages, HostWriteResult, PageFill
from .disk_format import (
    DiskEntry,
    PageRecords,
    atomic_write,
    check_layout,
    encode_index,
    fsync_dir,
    index_nbytes,
    page_name,
    read_exact,
    read_index,
    unlink,
    write_file,
)
from .lru import BytesBoundedTier, BytesLRU
from .page_codec import page_crcs
from .tier_codec import TierCodec, whole_fill

_SHARDS = 256


class RecoveryReport(NamedTuple):
    """What `bind` found in the directory."""

    users: int  # entries recovered
    dropped: int  # entries dropped: unreadable index, or a page file missing or short
    removed_files: int  # temporary files and page files no index referred to
    evicted: int  # users evicted to fit the capacity (it may have shrunk since the last run)


class DiskHostStorage(BytesBoundedTier):
    """Per-user KV pages in files under `directory`, bounded by `capacity_bytes` (page and index
    files), with its own LRU over users. See the module docstring for the format and recovery.

    `fsync=False` keeps the crash guarantees for a killed process (the page cache survives it)
    but not for a machine that loses power.
    """

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = True, codec: str = DEFAULT_CODEC) -> None:
        super().__init__(capacity_bytes)
        self.codec = TierCodec(codec)
        self.directory = Path(directory)
        self._fsync = bool(fsync)
        self._next_seq = 1
        self._lock_fd: int | None = None
        self._closer: weakref.finalize | None = None
        self.corrupt_reads = 0
        self.recovery: RecoveryReport | None = None

    # ------------------------------------------------------------------ lifecycle
    def bind(self, layout: PageLayout) -> None:
        """Lock the directory, check (or record) its layout, and recover a consistent state."""
        if self._layout is not None:
            super().bind(layout)  # the same layout again is a no-op; another one raises
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            check_layout(self.directory, layout)
            super().bind(layout)
            self.recovery = self._recover()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the directory lock (the data stays)."""
        if self._closer is not None:
            self._closer()

    def counters(self) -> dict[str, int]:
        return {"corrupt_reads": self.corrupt_reads}

    # ------------------------------------------------------------------ the contract
    def read(self, user_id: int) -> HostPages | None:
        """The user's pages in fresh memory, one read per page file, each checked against its crc32."""
        e = self._users.get(user_id)
        if e is None:
            return None
        offsets = np.zeros(len(e.sizes) + 1, dtype=np.int64)
        np.cumsum(e.sizes, out=offsets[1:])
        data = torch.empty(int(offsets[-1]), dtype=torch.uint8)
        encoded = EncodedPages(e.spec, data, offsets)
        rows = encoded.rows()
        shard = self._shard(user_id)
        for i, seq in enumerate(e.seqs.tolist()):
            try:
                with open(shard / page_name(user_id, i, seq), "rb", buffering=0) as f:
                    ok = read_exact(f, rows[i])
            except FileNotFoundError:
                ok = False
            if not ok or zlib.crc32(rows[i]) != e.crcs[i]:
                self.corrupt_reads += 1
                self.drop(user_id)
                return None
        self._users.touch(user_id)
        try:
            os.utime(shard / f"{user_id}.idx")  # recency that survives a restart
        except FileNotFoundError:
            self.corrupt_reads += 1
            self.drop(user_id)
            return None
        return HostPages(e.start_pos, e.length, self.codec.decode(self.layout, encoded), e.tag)

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        layout = self.layout
        old, num_pages = self._checked_write(user_id, start_pos, length, first_page)
        tag = bytes(tag)
        if old is not None and first_page and old.spec != self.codec.spec:  # one entry, one encoding
            kept = self.read(user_id)
            if kept is None:  # its pages were bad: dropped, so this write has nothing to continue
                return HostWriteResult(False, ())
            fill, first_page = whole_fill(kept.pages, first_page, fill), 0
        rows = self.codec.fill_and_encode(layout, num_pages - first_page, fill, lambda: self.drop(user_id)).rows()
        sizes = np.fromiter((len(r) for r in rows), dtype=np.uint32, count=len(rows))
        spec = self.codec.spec.encode()
        index_bytes = index_nbytes(tag, spec, num_pages)
        kept_sizes = old.sizes[:first_page] if first_page else sizes[:0]
        new_bytes = int(kept_sizes.sum()) + int(sizes.sum()) + index_bytes
        if new_bytes > self._capacity - self._users.protected_bytes(protect, user_id):
            return HostWriteResult(False, ())
        old_bytes = 0 if old is None else old.nbytes
        evicted = self._evict_to(self._capacity - new_bytes + old_bytes, keep={user_id, *protect})

        seq = self._next_seq
        self._next_seq += 1
        crcs = page_crcs(rows)
        shard = self._shard(user_id)
        written = []
        try:
            for i, row in enumerate(rows, start=first_page):
                path = shard / page_name(user_id, i, seq)
                written.append(path)
                write_file(path, row, self._fsync)
            if self._fsync:
                fsync_dir(shard)  # the page files' names are durable before the index refers to them
            records = PageRecords(np.full(num_pages - first_page, seq, dtype=np.uint64), crcs, sizes)
            if first_page:
                records = PageRecords(*(np.concatenate(pair) for pair in zip(old.records(first_page), records)))
            index = encode_index(start_pos, length, tag, spec, records)
            atomic_write(shard / f"{user_id}.idx", index, self._fsync)  # the commit
        except BaseException:
            for path in written:
                unlink(path)
            raise
        if old is not None:
            for i in range(first_page, len(old.seqs)):
                unlink(shard / page_name(user_id, i, int(old.seqs[i])))
        self._users.put(user_id, DiskEntry(start_pos, length, tag, self.codec.spec, records, new_bytes), new_bytes)
        return HostWriteResult(True, evicted)

    def drop(self, user_id: int) -> bool:
        e = self._users.pop(user_id)
        if e is None:
            return False
        shard = self._shard(user_id)
        unlink(shard / f"{user_id}.idx")  # first: a crash now leaves only unreferenced pages
        for i, seq in enumerate(e.seqs.tolist()):
            unlink(shard / page_name(user_id, i, seq))
        return True

    # ------------------------------------------------------------------ internals
    def _shard(self, user_id: int) -> Path:
        return self.directory / "users" / f"{user_id % _SHARDS:02x}"

    def _evict_to(self, target: int, keep: set[int]) -> tuple[tuple[int, HostEntry], ...]:
        """Drop least recently used users not in `keep` until at most `target` bytes are used."""
        evicted = []
        while self._users.bytes_used > target:
            victim = self._users.victim(keep)  # exists: the caller checked the room
            evicted.append((victim, self._users.get(victim).info))
            self.drop(victim)
        return tuple(evicted)

    def _lock(self) -> None:
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RuntimeError(
                    f"{self.directory} is in use by another DiskHostStorage (this or another process); "
                    "a persistent KV directory has one user at a time."
                ) from exc
            raise
        self._lock_fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def _recover(self) -> RecoveryReport:
        """Rebuild the index from the files: keep complete, consistent entries; remove the rest."""
        layout = self.layout
        found: list[tuple[int, int, DiskEntry]] = []  # (mtime, user, entry)
        dropped = removed = 0
        max_seq = 0
        for s in range(_SHARDS):
            shard = self.directory / "users" / f"{s:02x}"
            shard.mkdir(parents=True, exist_ok=True)
            indexes, pages = [], {}
            with os.scandir(shard) as it:
                for de in it:
                    if de.name.endswith(".tmp"):
                        unlink(Path(de.path))
                        removed += 1
                    elif de.name.endswith(".idx"):
                        indexes.append(de)
                    elif de.name.endswith(".kv"):
                        pages[de.name] = de
            referenced: set[str] = set()
            for de in indexes:
                user = _parse_int(de.name[: -len(".idx")])
                entry = None if user is None or user % _SHARDS != s else read_index(Path(de.path), layout)
                names = [] if entry is None else [page_name(user, i, q) for i, q in enumerate(entry.seqs.tolist())]
                if entry is None or not all(n in pages and pages[n].stat().st_size == size
                                            for n, size in zip(names, entry.sizes.tolist())):
                    unlink(Path(de.path))
                    dropped += 1
                    continue
                referenced.update(names)
                found.append((de.stat().st_mtime_ns, user, entry))
                max_seq = max(max_seq, int(entry.seqs.max()))
            for name, de in pages.items():
                if name not in referenced:
                    unlink(Path(de.path))
                    removed += 1
        found.sort(key=lambda t: (t[0], int(t[2].seqs.max())))  # mtime, then the last write (coarse clocks)
        self._users = BytesLRU()
        for _, user, entry in found:
            self._users.put(user, entry, entry.nbytes)
        self._next_seq = max_seq + 1
        evicted = self._evict_to(self._capacity, keep=set())
        return RecoveryReport(len(self._users), dropped, removed, len(evicted))


def _parse_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None
