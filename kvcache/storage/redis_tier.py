"""RedisHostStorage: a KV tier shared by many inference nodes, on a Redis server they all reach.

A user served by node A and later by node B reuses the K/V that A offloaded, instead of
recomputing its history. The tier speaks the `HostKVStorage` contract in pages of one
`PageLayout` (docs/kvcache.md, "Redis tier", draws the keys).

Keys (`P` = `hstu:{namespace}:{layout hash}`: a changed model or page geometry never reads
another one's K/V, it sees other keys):

* `P:u:{user}:meta`  hash: start_pos, length, pages, tag, crc (little-endian crc32 per page),
  pv (comma-separated version of each page), sz (comma-separated bytes of each page), codec
  (the spec of the codec that encoded the pages), version (of the last write);
* `P:u:{user}:p:{version}:{i}`  page `i` as written by write `version`: its encoding by the
  entry's codec (raw: the blob, kvcache/page_data.py: K/V `[L, 2, S, H, D]`, then the tokens'
  times). A write encodes with the tier's codec; a read decodes with the entry's. Page keys are never
  overwritten (versions come from `INCR P:seq`), so pages referenced by a meta are exactly the
  bytes that meta's checksums describe;
* `P:lru` (zset user -> access stamp), `P:sizes` (hash user -> page bytes), `P:bytes` (their
  sum), `P:seq` (the counter behind versions and access stamps), shared by all writers.

A write uploads its pages under a fresh version (with a pending expiry, so a writer that dies
mid-write leaks nothing for long), then one Lua script checks and switches the meta, evicts
least recently used users of the namespace until the bytes fit, and deletes the pages the
new meta no longer references. Readers see the old entry or the new one, never a mix, and
the last complete write wins; an incremental write whose base was replaced by another node
in between is not stored (`stored=False`, counted in `write_conflicts`).

Failures: connection problems and timeouts raise redis-py's errors; a page whose size or
checksum disagrees with the meta raises `TierDataError` (after dropping that entry). Wrapped
in `FailOpenStorage`, both become misses. Nothing partial or unchecked is ever returned.
"""
from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Collection, Iterator
from typing import NamedTuple, NoReturn

import numpy as np
import redis
import torch

from ..codecs import DEFAULT_CODEC, EncodedPages
from ..page_data import PageData
from ..page_layout import PageLayout
from . import redis_scripts
from .base import (
    HostEntry,
    HostKVStorage,
    HostPages,
    HostWriteResult,
    PageFill,
    TierDataError,
    check_write_range,
    continues,
)
from .page_codec import page_crcs
from .redis_page_reader import PageReader
from .tier_codec import TierCodec, whole_fill

PENDING_PAGE_MS = 300_000  # uploaded pages not yet committed expire after this (a crashed writer's)
_READ_ATTEMPTS = 3  # a read that races a concurrent write re-reads the new meta this often

class _Meta(NamedTuple):
    """A decoded `P:u:{user}:meta` hash."""

    start_pos: int
    length: int
    tag: bytes
    crc: np.ndarray  # [pages] uint32
    versions: list[bytes]  # [pages]: the write that holds each page (names its key)
    version: bytes  # the entry's last write
    sizes: np.ndarray  # [pages] int64: bytes of each page
    codec: str  # the spec of the codec that encoded the pages

    @classmethod
    def parse(cls, raw: dict[bytes, bytes], layout: PageLayout) -> _Meta:
        """Decode and cross-check a meta hash; malformed metadata is a `TierDataError`."""
        try:
            start, length, pages = int(raw[b"start"]), int(raw[b"length"]), int(raw[b"pages"])
            crc = np.frombuffer(raw[b"crc"], dtype="<u4")
            sizes = np.array([int(x) for x in raw[b"sz"].split(b",")], dtype=np.int64)
            meta = cls(start, length, raw[b"tag"], crc, raw[b"pv"].split(b","), raw[b"version"], sizes,
                       raw[b"codec"].decode())
        except (KeyError, ValueError) as exc:
            raise TierDataError(f"malformed meta (fields {sorted(raw)}): {exc!r}") from exc
        if (start < 0 or length <= 0 or pages != layout.num_pages(length) or len(crc) != pages
                or len(meta.versions) != pages or len(sizes) != pages or (sizes < 0).any()):
            raise TierDataError(f"inconsistent meta: start {start}, length {length}, {pages} pages, "
                                f"{len(crc)} checksums, {len(meta.versions)} page versions")
        return meta


def layout_hash(layout: PageLayout) -> str:
    """A short stable id of the page format: geometry, dtype and blob size (part of every key)."""
    text = (f"{layout.num_layers}x{layout.num_heads}x{layout.head_dim}:page{layout.page_size}:{layout.dtype}"
            f":{layout.page_nbytes}B")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class RedisHostStorage(HostKVStorage):
    """Per-user KV pages in Redis under `namespace` (pass a model fingerprint), bounded by `capacity_bytes`.

    `capacity_bytes` bounds the page bytes of the namespace over all writers (they share one
    LRU); metadata and Redis's own overheads come on top (docs/kvcache.md). `ttl_seconds`
    expires a user's keys that long after its last write or read. Every Redis call is bounded
    by `timeout_s` (socket timeouts; None: unbounded) and failures raise: wrap the tier in
    `FailOpenStorage`. Like every tier, an instance serves one caller at a time; any number of
    processes and nodes may share a namespace.
    """

    shared = True

    def __init__(self, url: str, namespace: str, capacity_bytes: int, ttl_seconds: int | None = None,
                 timeout_s: float | None = 0.5, codec: str = DEFAULT_CODEC) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}.")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0 or None, got {ttl_seconds}.")
        if not namespace:
            raise ValueError("namespace must be a non-empty string (e.g. the model fingerprint).")
        self.namespace = namespace
        self.codec = TierCodec(codec)
        self.prefix = ""  # set by bind
        self._capacity = int(capacity_bytes)
        self._ttl = int(ttl_seconds or 0)
        # No I/O here nor in bind: a node must start, and fail open, while Redis is down.
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._commit = self._redis.register_script(redis_scripts.COMMIT)
        self._read_meta = self._redis.register_script(redis_scripts.READ_META)
        self._pages = PageReader(self._redis.connection_pool)
        self._drop = self._redis.register_script(redis_scripts.DROP)
        self.write_conflicts = 0  # incremental writes refused: another writer replaced their base entry
        self.lost_reads = 0  # entries whose pages vanished under a reader (TTL, a Redis maxmemory policy)
        self.corrupt_reads = 0  # entries dropped for failing their checks (also raised as TierDataError)

    def bind(self, layout: PageLayout) -> None:
        super().bind(layout)
        self.prefix = f"hstu:{self.namespace}:{layout_hash(layout)}"

    def close(self) -> None:
        self._pages.close()
        self._redis.close()

    def counters(self) -> dict[str, int]:
        # corrupt reads are raised as TierDataError, which FailOpenStorage counts: not repeated here
        return {"write_conflicts": self.write_conflicts, "lost_reads": self.lost_reads}

    # ------------------------------------------------------------------ sizes
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def bytes_used(self) -> int:
        """Page bytes of the namespace (all writers), as accounted by the write script."""
        return int(self._redis.get(f"{self.prefix}:bytes") or 0)

    @property
    def num_users(self) -> int:
        """Users in the namespace's LRU (with a TTL, expired users count until evicted or rewritten)."""
        return int(self._redis.zcard(f"{self.prefix}:lru"))

    # ------------------------------------------------------------------ the contract
    def info(self, user_id: int) -> HostEntry | None:
        with self._own_keys(user_id):
            start, length, tag = self._redis.hmget(self._meta_key(user_id), "start", "length", "tag")
        if start is None:
            return None
        try:
            return HostEntry(int(start), int(length), tag)
        except (TypeError, ValueError) as exc:
            self._bad_entry(user_id, b"", f"malformed meta: {exc!r}")

    def read(self, user_id: int) -> HostPages | None:
        """The user's pages in fresh memory, each checked against its size and crc32 in the meta.

        Two round trips: the meta (with the recency touch), then its pages straight into the
        tensor. Page keys are never rewritten, so pages that are all there are the ones the meta
        describes; one missing means a concurrent write replaced the entry (read again) or the
        entry was lost (a miss).
        """
        for _ in range(_READ_ATTEMPTS):
            with self._own_keys(user_id):
                raw = self._read_meta(keys=[self._meta_key(user_id), f"{self.prefix}:lru", f"{self.prefix}:seq"],
                                      args=[self.prefix, user_id, self._ttl])
            if not raw:
                return None
            meta = self._parse(user_id, dict(zip(raw[::2], raw[1::2])))
            offsets = np.zeros(len(meta.sizes) + 1, dtype=np.int64)
            np.cumsum(meta.sizes, out=offsets[1:])
            encoded = EncodedPages(meta.codec, torch.empty(int(offsets[-1]), dtype=torch.uint8), offsets)
            rows = encoded.rows()
            lengths = self._pages.mget_into([self._page_key(user_id, v, i) for i, v in enumerate(meta.versions)], rows)
            if -1 not in lengths:
                for i, (n, row) in enumerate(zip(lengths, rows)):
                    if n != len(row) or zlib.crc32(row) != meta.crc[i]:
                        self._bad_entry(user_id, meta.version, f"page {i} of write {meta.version.decode()} has {n} "
                                        f"bytes (expected {len(row)}) or a wrong checksum")
                return HostPages(meta.start_pos, meta.length, self._decode(user_id, meta, encoded), meta.tag)
            if self._redis.hget(self._meta_key(user_id), "version") == meta.version:
                self.lost_reads += 1
                self._drop(keys=[self._meta_key(user_id)], args=[self.prefix, user_id, meta.version])
                return None
        return None  # the entry keeps changing under us: a miss is always safe

    def _drop_after_failed_fill(self, user_id: int) -> None:
        """The contract: a failed fill drops the entry (nothing was sent); the fill's error is the one to report."""
        with contextlib.suppress(redis.RedisError):
            self.drop(user_id)

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        """Upload pages `[first_page, n)` under a fresh version, then commit them with one script.

        Not stored (`stored=False`, nothing changed): the user alone exceeds the capacity, or does
        not fit beside `protect`, or another writer replaced or dropped the entry this write
        continues (before or during the upload; `write_conflicts` counts both).
        """
        layout = self.layout
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(self._meta_key(user_id), "start", "length", "version", "codec")
        pipe.incr(f"{self.prefix}:seq")
        with self._own_keys(user_id):
            (start, held_length, base, held_codec), version = pipe.execute()
        held = None if start is None else HostEntry(int(start), int(held_length))
        num_pages = check_write_range(layout, user_id, length, first_page)
        if not continues(layout, start_pos, first_page, held):  # another node dropped or replaced it since
            self.write_conflicts += 1
            return HostWriteResult(False, ())
        if first_page and held_codec != self.codec.spec.encode():  # one entry, one encoding: rewrite it whole
            kept = self.read(user_id)
            if kept is None or kept.entry[:2] != held[:2]:
                self.write_conflicts += 1
                return HostWriteResult(False, ())
            fill, first_page = whole_fill(kept.pages, first_page, fill), 0
        rows = self.codec.fill_and_encode(
            layout, num_pages - first_page, fill, lambda: self._drop_after_failed_fill(user_id)).rows()
        if sum(len(row) for row in rows) > self._capacity:
            return HostWriteResult(False, ())
        pipe = self._redis.pipeline(transaction=False)
        for i, row in enumerate(rows, start=first_page):
            pipe.set(self._page_key(user_id, version, i), memoryview(row), px=PENDING_PAGE_MS)
        self._commit(
            keys=[self._meta_key(user_id)],
            args=[self.prefix, user_id, base or b"", first_page, num_pages, version, start_pos, length, bytes(tag),
                  page_crcs(rows).astype("<u4").tobytes(), ",".join(str(len(row)) for row in rows),
                  self._capacity, self._ttl, self.codec.spec,
                  *sorted({int(u) for u in protect} - {user_id})],
            client=pipe,
        )
        reply = pipe.execute()[-1]
        if reply[0] == b"conflict":
            self.write_conflicts += 1
        if reply[0] != b"ok":
            return HostWriteResult(False, ())
        v = reply[1:]  # user, start, length, tag per evicted user
        evicted = tuple((int(v[i]), HostEntry(int(v[i + 1]), int(v[i + 2]), v[i + 3])) for i in range(0, len(v), 4))
        return HostWriteResult(True, evicted)

    def drop(self, user_id: int) -> bool:
        return bool(self._drop(keys=[self._meta_key(user_id)], args=[self.prefix, user_id, b""]))

    # ------------------------------------------------------------------ internals
    def _meta_key(self, user_id: int) -> str:
        return f"{self.prefix}:u:{user_id}:meta"

    def _page_key(self, user_id: int, version: int | bytes, page: int) -> str:
        if isinstance(version, bytes):
            version = version.decode()
        return f"{self.prefix}:u:{user_id}:p:{version}:{page}"

    @contextlib.contextmanager
    def _own_keys(self, user_id: int) -> Iterator[None]:
        """Around a call on the user's meta key: a key of another Redis type there (something else wrote
        it) is one corrupt entry, dropped and raised as `TierDataError`, not a failure of the whole tier."""
        try:
            yield
        except redis.ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                kind = self._redis.type(self._meta_key(user_id))
                if kind not in (b"hash", b"none"):
                    self._bad_entry(user_id, b"", f"its meta key holds a Redis {kind.decode()}, not a hash")
            raise

    def _parse(self, user_id: int, raw: dict[bytes, bytes]) -> _Meta:
        try:
            return _Meta.parse(raw, self.layout)
        except TierDataError as exc:
            self._bad_entry(user_id, b"", str(exc))

    def _decode(self, user_id: int, meta: _Meta, encoded: EncodedPages) -> PageData:
        """The entry's pages decoded by the codec its meta names; an entry no codec decodes is a bad entry."""
        try:
            return self.codec.decode(self.layout, encoded)
        except ValueError as exc:
            self._bad_entry(user_id, meta.version, f"its pages do not decode ({exc})")

    def _bad_entry(self, user_id: int, version: bytes, problem: str) -> NoReturn:
        """Drop an entry that failed its checks (`version`, or any) and raise: it would fail every later read."""
        self.corrupt_reads += 1
        self._drop(keys=[self._meta_key(user_id)], args=[self.prefix, user_id, version])
        raise TierDataError(f"Redis tier, user {user_id}: {problem}; the entry was dropped.")
