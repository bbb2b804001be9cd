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

from ..codecs import EncodedPages
from ..config import PageLayout
from ..page_data import PageData
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
from .tier_codec import TierCodec, whole_fill

PENDING_PAGE_MS = 300_000  # uploaded pages not yet committed expire after this (a crashed writer's)
_READ_ATTEMPTS = 3  # a read that races a concurrent write re-reads the new meta this often

# Lua helpers shared by the scripts. Page keys are built here and in `RedisHostStorage._page_key`:
# keep the two formats identical.
_LUA_COMMON = """
local function page_key(prefix, user, version, i) return prefix .. ':u:' .. user .. ':p:' .. version .. ':' .. i end
local function split(s)
  local out = {}
  if s then for x in string.gmatch(s, '[^,]+') do out[#out + 1] = x end end
  return out
end
local function del_keys(keys)  -- in chunks: unpack() is limited by Lua's stack
  for i = 1, #keys, 512 do redis.call('DEL', unpack(keys, i, math.min(i + 511, #keys))) end
end
local function entry_keys(prefix, user, pv)
  local keys = {}
  for i, v in ipairs(split(pv)) do keys[i] = page_key(prefix, user, v, i - 1) end
  return keys
end
-- A meta key of another type (not written by this tier) holds no entry: it is only deleted.
local function is_meta(meta) return redis.call('TYPE', meta).ok == 'hash' end
-- Forget a user: its pages, meta and accounting. Returns start, length, tag (false if expired).
local function forget(prefix, user)
  local meta = prefix .. ':u:' .. user .. ':meta'
  local m = {false, false, false, false}
  if is_meta(meta) then m = redis.call('HMGET', meta, 'start', 'length', 'tag', 'pv') end
  del_keys(entry_keys(prefix, user, m[4]))
  redis.call('DEL', meta)
  local size = tonumber(redis.call('HGET', prefix .. ':sizes', user)) or 0
  if size > 0 then redis.call('DECRBY', prefix .. ':bytes', size) end
  redis.call('HDEL', prefix .. ':sizes', user)
  redis.call('ZREM', prefix .. ':lru', user)
  return m
end
"""

# KEYS[1] meta. ARGV: prefix, user, base version ('' = none), first page, pages, version, start,
# length, tag, crc of the new pages, their sizes (comma-separated), capacity, ttl (0 = none), codec,
# protected users...
_COMMIT = _LUA_COMMON + """
local prefix, user, base = ARGV[1], ARGV[2], ARGV[3]
local first, n, version = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local capacity, ttl, codec = tonumber(ARGV[12]), tonumber(ARGV[13]), ARGV[14]
local meta = KEYS[1]
local new_keys = {}
for i = first, n - 1 do new_keys[#new_keys + 1] = page_key(prefix, user, version, i) end
local function abort(why) del_keys(new_keys); return {why} end

if redis.call('EXISTS', meta) == 1 and not is_meta(meta) then forget(prefix, user) end
local cur = redis.call('HMGET', meta, 'version', 'pv', 'crc', 'sz')
if first > 0 and cur[1] ~= base then return abort('conflict') end
local present = 0
for i = 1, #new_keys, 512 do
  present = present + redis.call('EXISTS', unpack(new_keys, i, math.min(i + 511, #new_keys)))
end
if present ~= #new_keys then return abort('lost') end

local sizes = prefix .. ':sizes'
local keep, pinned = {[user] = true}, 0
for i = 15, #ARGV do
  if not keep[ARGV[i]] then
    keep[ARGV[i]] = true
    if redis.call('EXISTS', prefix .. ':u:' .. ARGV[i] .. ':meta') == 1 then
      pinned = pinned + (tonumber(redis.call('HGET', sizes, ARGV[i])) or 0)
    end
  end
end
-- The entry's bytes: its kept pages' and the new ones'.
local sz, need = split(cur[4]), 0
for i = 1, first do need = need + (tonumber(sz[i]) or 0) end
local new_sz = split(ARGV[11])
for i = 1, #new_sz do need = need + tonumber(new_sz[i]); sz[first + i] = new_sz[i] end
for i = #sz, n + 1, -1 do sz[i] = nil end
if need + pinned > capacity then return abort('full') end

-- Evict least recently used users (never `keep`) until the namespace fits.
local result = {'ok'}
local total = (tonumber(redis.call('GET', prefix .. ':bytes')) or 0)
  - (tonumber(redis.call('HGET', sizes, user)) or 0) + need
local rank = 0
while total > capacity do
  local victim = redis.call('ZRANGE', prefix .. ':lru', rank, rank)[1]
  if not victim then break end
  if keep[victim] then
    rank = rank + 1
  else
    total = total - (tonumber(redis.call('HGET', sizes, victim)) or 0)
    local m = forget(prefix, victim)
    if m[1] then
      result[#result + 1] = victim; result[#result + 1] = m[1]; result[#result + 1] = m[2]
      result[#result + 1] = m[3]
    end
  end
end

-- Switch: keep pages [0, first) of the current entry, drop the rest of it, point at the new pages.
local old = split(cur[2])
local dead, pv = {}, {}
for i = 1, #old do
  if i <= first then pv[i] = old[i] else dead[#dead + 1] = page_key(prefix, user, old[i], i - 1) end
end
del_keys(dead)
for i = first + 1, n do pv[i] = version end
local crc = string.sub(cur[3] or '', 1, 4 * first) .. ARGV[10]
redis.call('HSET', meta, 'start', ARGV[7], 'length', ARGV[8], 'pages', n, 'tag', ARGV[9], 'crc', crc,
  'pv', table.concat(pv, ','), 'sz', table.concat(sz, ','), 'codec', codec, 'version', version)
redis.call('HSET', sizes, user, need)
redis.call('SET', prefix .. ':bytes', total)
redis.call('ZADD', prefix .. ':lru', redis.call('INCR', prefix .. ':seq'), user)
if ttl > 0 then
  redis.call('EXPIRE', meta, ttl)
  for _, key in ipairs(entry_keys(prefix, user, table.concat(pv, ','))) do redis.call('EXPIRE', key, ttl) end
else
  redis.call('PERSIST', meta)
  for _, key in ipairs(new_keys) do redis.call('PERSIST', key) end
end
return result
"""

# KEYS: meta, lru, seq. ARGV: prefix, user, ttl (0 = none). The meta hash (flat; empty if none),
# and the user marked recently used (its keys' TTL refreshed).
_READ_META = _LUA_COMMON + """
local m = redis.call('HGETALL', KEYS[1])
if #m == 0 then return m end
redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[3]), ARGV[2])
local ttl = tonumber(ARGV[3])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[1], ttl)
  for _, key in ipairs(entry_keys(ARGV[1], ARGV[2], redis.call('HGET', KEYS[1], 'pv'))) do
    redis.call('EXPIRE', key, ttl)
  end
end
return m
"""

# KEYS[1] meta. ARGV: prefix, user, version ('' = any). Returns 1 if an entry was dropped.
_DROP = _LUA_COMMON + """
if redis.call('EXISTS', KEYS[1]) == 1 and not is_meta(KEYS[1]) then forget(ARGV[1], ARGV[2]); return 1 end
local version = redis.call('HGET', KEYS[1], 'version')
if ARGV[3] ~= '' and version ~= ARGV[3] then return 0 end
forget(ARGV[1], ARGV[2])
if version then return 1 end
return 0
"""


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
                 timeout_s: float | None = 0.5, codec: str = "raw") -> None:
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
        self._commit = self._redis.register_script(_COMMIT)
        self._read_meta = self._redis.register_script(_READ_META)
        self._pages = _PageReader(self._redis.connection_pool)
        self._drop = self._redis.register_script(_DROP)
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


class _PageReader:
    """`MGET` whose values land straight in the caller's rows, one copy each.

    redis-py's parser copies every value 3-4 times (socket chunks -> BytesIO -> bytes -> slices):
    an MGET of 384 KiB pages ran at 0.3-0.6 GB/s here, 3-4x slower than reading the reply with
    `recv_into` the destination. The connection is redis-py's (URL, AUTH, SELECT, TLS, timeouts),
    private to this reader; only its reply is parsed here.
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._conn: redis.Connection | None = None
        self._pending = bytearray()  # bytes received past the header being parsed

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
        self._conn = None
        self._pending.clear()

    def mget_into(self, keys: list[str], rows: list[np.ndarray]) -> list[int]:
        """Each key's value into its row of `rows` (uint8 arrays, one per key) when it is exactly row-sized
        (other values are read and discarded); returns the values' lengths, -1 for a missing key."""
        if self._conn is None:
            self._conn = self._pool.connection_class(**self._pool.connection_kwargs)
        try:
            self._conn.send_command("MGET", *keys)  # connects first if needed
            sock = self._conn._sock  # the reply is read here, not by redis-py's parser
            head = self._line(sock)
            if head.startswith(b"-"):
                raise redis.ResponseError(head[1:].decode(errors="replace"))
            if head != b"*%d" % len(keys):
                raise redis.ConnectionError(f"unexpected reply to MGET: {head[:40]!r}")
            lengths = []
            for row in rows:
                head = self._line(sock)
                if not head.startswith(b"$"):
                    raise redis.ConnectionError(f"unexpected value header in MGET reply: {head[:40]!r}")
                n = int(head[1:])
                lengths.append(n)
                if n >= 0:
                    self._read_into(sock, memoryview(row) if n == len(row) else memoryview(bytearray(n)))
                    self._read_into(sock, memoryview(bytearray(2)))  # the value's CRLF
            return lengths
        except BaseException as exc:
            self.close()  # whatever was left of the reply is garbage now
            if isinstance(exc, TimeoutError):
                raise redis.TimeoutError(f"Timeout reading pages: {exc}") from exc
            if isinstance(exc, OSError):
                raise redis.ConnectionError(f"Error reading pages: {exc}") from exc
            raise

    def _line(self, sock) -> bytes:
        while (end := self._pending.find(b"\r\n")) < 0:
            self._recv(sock, 64)  # headers are short: never read far into the next value
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _read_into(self, sock, view: memoryview) -> None:
        done = min(len(self._pending), len(view))
        view[:done] = self._pending[:done]
        del self._pending[:done]
        while done < len(view):
            n = sock.recv_into(view[done:])
            if not n:
                raise ConnectionError("Redis closed the connection")
            done += n

    def _recv(self, sock, n: int) -> None:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("Redis closed the connection")
        self._pending += chunk
