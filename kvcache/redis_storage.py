"""RedisHostStorage: a KV tier shared by many inference nodes, on a Redis server they all reach.

A user served by node A and later by node B reuses the K/V that A offloaded, instead of
recomputing its history. The tier speaks the `HostKVStorage` contract in pages of one
`PageLayout` (docs/kvcache.md, "Redis tier", draws the keys).

Keys (`P` = `hstu:{namespace}:{layout hash}`: a changed model or page geometry never reads
another one's K/V, it sees other keys):

* `P:u:{user}:meta`  hash: start_pos, length, pages, tag, crc (little-endian crc32 per page),
  pv (comma-separated version of each page), version (of the last write);
* `P:u:{user}:p:{version}:{i}`  page `i` as written by write `version`: one page-major
  `[L, 2, S, H, D]` blob. Page keys are never overwritten (versions come from `INCR P:seq`), so
  pages referenced by a meta are exactly the bytes that meta's checksums describe;
* `P:lru` (zset user -> access stamp), `P:sizes` (hash user -> page bytes), `P:bytes` (their
  sum), `P:seq` (the counter behind versions and access stamps), shared by all writers.

A write uploads its pages under a fresh version (with a pending expiry, so a writer that dies
mid-write leaks nothing for long), then one Lua script checks and switches the meta, evicts
least recently used users of the namespace until the bytes fit, and deletes the pages the
new meta no longer references. Readers see the old entry or the new one, never a mix, and
the last complete write wins; an incremental write whose base was replaced by another node
in between is not stored (`stored=False`, counted in `stats.conflicts`).

Failures: connection problems and timeouts raise redis-py's errors; a page whose size or
checksum disagrees with the meta raises `TierDataError` (after dropping that entry). Wrapped
in `FailOpenStorage`, both become misses. Nothing partial or unchecked is ever returned.
"""
from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from typing import Collection, NamedTuple

import numpy as np
import redis
import torch
from torch import Tensor

from .config import PageLayout
from .host_storage import HostEntry, HostKVStorage, HostPages, HostWriteResult, PageFill

PENDING_PAGE_MS = 300_000  # uploaded pages not yet committed expire after this (a crashed writer's)
_SOCKET_READ_BYTES = 1 << 20  # redis-py reads 64 KiB per recv by default: 2x slower on MB-sized pages
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
-- Forget a user: its pages, meta and accounting. Returns start, length, tag (false if expired).
local function forget(prefix, user)
  local meta = prefix .. ':u:' .. user .. ':meta'
  local m = redis.call('HMGET', meta, 'start', 'length', 'tag', 'pv')
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
# length, tag, crc of the new pages, page bytes, capacity, ttl (0 = none), protected users...
_COMMIT = _LUA_COMMON + """
local prefix, user, base = ARGV[1], ARGV[2], ARGV[3]
local first, n, version = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local page_bytes, capacity, ttl = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local meta = KEYS[1]
local new_keys = {}
for i = first, n - 1 do new_keys[#new_keys + 1] = page_key(prefix, user, version, i) end
local function abort(why) del_keys(new_keys); return {why} end

local cur = redis.call('HMGET', meta, 'version', 'pv', 'crc')
if first > 0 and cur[1] ~= base then return abort('conflict') end
local present = 0
for i = 1, #new_keys, 512 do
  present = present + redis.call('EXISTS', unpack(new_keys, i, math.min(i + 511, #new_keys)))
end
if present ~= #new_keys then return abort('lost') end

local sizes = prefix .. ':sizes'
local keep, pinned = {[user] = true}, 0
for i = 14, #ARGV do
  if not keep[ARGV[i]] then
    keep[ARGV[i]] = true
    if redis.call('EXISTS', prefix .. ':u:' .. ARGV[i] .. ':meta') == 1 then
      pinned = pinned + (tonumber(redis.call('HGET', sizes, ARGV[i])) or 0)
    end
  end
end
local need = n * page_bytes
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
  'pv', table.concat(pv, ','), 'version', version)
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

# KEYS: lru, seq, then the entry's keys (meta, pages). ARGV: user, ttl (0 = none).
_TOUCH = """
redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[2]), ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then for i = 3, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end end
return 1
"""

# KEYS[1] meta. ARGV: prefix, user, version ('' = any). Returns 1 if an entry was dropped.
_DROP = _LUA_COMMON + """
local version = redis.call('HGET', KEYS[1], 'version')
if ARGV[3] ~= '' and version ~= ARGV[3] then return 0 end
forget(ARGV[1], ARGV[2])
if version then return 1 end
return 0
"""


class TierDataError(RuntimeError):
    """A tier holds data that fails its own checks (size, checksum, malformed metadata).

    Never returned as K/V: the reader drops the entry and raises; `FailOpenStorage` counts it
    as a miss.
    """


@dataclass
class RedisTierStats:
    """What this client saw (per process; the shared state is in Redis)."""

    conflicts: int = 0  # incremental writes refused because another writer replaced the base entry
    bad_reads: int = 0  # entries dropped because a page failed its size or checksum check
    lost_reads: int = 0  # entries whose pages vanished (TTL, eviction by another node) under a reader


class _Meta(NamedTuple):
    start_pos: int
    length: int
    tag: bytes
    crc: np.ndarray  # [pages] uint32
    versions: list[bytes]  # [pages]: the write that holds each page
    version: bytes  # the entry's last write

    @classmethod
    def parse(cls, raw: dict[bytes, bytes], layout: PageLayout) -> "_Meta":
        """Decode and cross-check a meta hash; malformed metadata is a `TierDataError`."""
        try:
            start, length, pages = int(raw[b"start"]), int(raw[b"length"]), int(raw[b"pages"])
            crc = np.frombuffer(raw[b"crc"], dtype="<u4")
            versions = raw[b"pv"].split(b",")
            meta = cls(start, length, raw[b"tag"], crc, versions, raw[b"version"])
        except (KeyError, ValueError) as exc:
            raise TierDataError(f"malformed meta {sorted(raw)}: {exc}") from exc
        if length <= 0 or start < 0 or pages != layout.num_pages(length) or len(crc) != pages or len(versions) != pages:
            raise TierDataError(f"inconsistent meta: start {start}, length {length}, {pages} pages, "
                                f"{len(crc)} checksums, {len(versions)} versions")
        return meta

    @property
    def entry(self) -> HostEntry:
        return HostEntry(self.start_pos, self.length, self.tag)


def layout_hash(layout: PageLayout) -> str:
    """A short stable id of the page geometry and dtype (part of every key)."""
    text = f"{layout.num_layers}x{layout.num_heads}x{layout.head_dim}:page{layout.page_size}:{layout.dtype}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class RedisHostStorage(HostKVStorage):
    """Per-user KV pages in Redis under `namespace` (pass a model fingerprint), bounded by `capacity_bytes`.

    `capacity_bytes` bounds the page bytes of the namespace over all writers (the LRU is
    shared); metadata adds about 100 bytes + 16 per page per user (docs/kvcache.md).
    `ttl_seconds` expires a user's keys that long after its last write or read.
    Every Redis call is bounded by `timeout_s`; failures raise (wrap in `FailOpenStorage`).
    Like every tier, an instance is not thread-safe; several processes or nodes may share a
    namespace.
    """

    def __init__(self, url: str, namespace: str, capacity_bytes: int, ttl_seconds: int | None = None,
                 timeout_s: float = 0.5) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}.")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0 or None, got {ttl_seconds}.")
        if not namespace:
            raise ValueError("namespace must be a non-empty string (e.g. the model fingerprint).")
        self.namespace = namespace
        self._capacity = int(capacity_bytes)
        self._ttl = int(ttl_seconds or 0)
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, socket_read_size=_SOCKET_READ_BYTES,
        )
        self._commit = self._redis.register_script(_COMMIT)
        self._touch = self._redis.register_script(_TOUCH)
        self._drop = self._redis.register_script(_DROP)
        self._staging: Tensor | None = None  # reused write buffer [pages, *page_shape]
        self.stats = RedisTierStats()

    def bind(self, layout: PageLayout) -> None:
        """No I/O here: a node must start (and fail open) while Redis is down."""
        super().bind(layout)
        self.prefix = f"hstu:{self.namespace}:{layout_hash(layout)}"

    def close(self) -> None:
        self._redis.close()

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
        start, length, tag = self._redis.hmget(self._meta_key(user_id), "start", "length", "tag")
        if start is None:
            return None
        try:
            return HostEntry(int(start), int(length), tag or b"")
        except (TypeError, ValueError) as exc:
            raise TierDataError(f"user {user_id}: malformed meta: {exc}") from exc

    def read(self, user_id: int) -> HostPages | None:
        """The user's pages in a fresh tensor, checked page by page against the meta's checksums."""
        for _ in range(_READ_ATTEMPTS):
            raw = self._redis.hgetall(self._meta_key(user_id))
            if not raw:
                return None
            meta = self._parse(user_id, raw)
            keys = [self._page_key(user_id, v, i) for i, v in enumerate(meta.versions)]
            pipe = self._redis.pipeline(transaction=False)
            pipe.mget(keys)
            self._touch(keys=[f"{self.prefix}:lru", f"{self.prefix}:seq", self._meta_key(user_id), *keys],
                        args=[user_id, self._ttl], client=pipe)
            blobs, _ = pipe.execute()
            if all(b is not None for b in blobs):
                return HostPages(meta.start_pos, meta.length, self._decode(user_id, meta, blobs), meta.tag)
            # A page is gone: a concurrent write replaced the entry (read again), or it was lost.
            if self._redis.hget(self._meta_key(user_id), "version") == meta.version:
                self.stats.lost_reads += 1
                self._drop(keys=[self._meta_key(user_id)], args=[self.prefix, user_id, meta.version])
                return None
        return None  # the entry keeps changing under us: a miss is always safe

    def write(
        self, user_id: int, start_pos: int, length: int, first_page: int, fill: PageFill,
        protect: Collection[int] = (), tag: bytes = b"",
    ) -> HostWriteResult:
        layout = self.layout
        num_pages = layout.num_pages(length)
        if length <= 0 or not 0 <= first_page < num_pages:
            raise ValueError(f"User {user_id}: cannot write pages [{first_page}, {num_pages}) for {length} tokens.")
        if num_pages * layout.page_nbytes > self._capacity:
            return HostWriteResult(False, ())
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self._meta_key(user_id))
        pipe.incr(f"{self.prefix}:seq")
        raw, version = pipe.execute()
        base = self._parse(user_id, raw) if raw else None
        if first_page > 0 and (base is None or base.start_pos != start_pos or len(base.versions) < first_page):
            raise ValueError(f"User {user_id}: writing from page {first_page} at start {start_pos} would leave a "
                             f"gap; the tier holds {None if base is None else base.entry}.")
        dst = self._staging_pages(num_pages - first_page)
        try:
            fill(dst)
        except BaseException:
            try:
                self.drop(user_id)
            except redis.RedisError:
                pass  # the fill error is the one to report; the entry was not touched anyway
            raise
        rows = dst.view(torch.uint8).numpy().reshape(dst.shape[0], layout.page_nbytes)  # shares dst's memory
        crc = np.fromiter((zlib.crc32(row) for row in rows), dtype="<u4", count=len(rows))
        pipe = self._redis.pipeline(transaction=False)
        for i, row in enumerate(rows, start=first_page):
            pipe.set(self._page_key(user_id, version, i), memoryview(row), px=PENDING_PAGE_MS)
        self._commit(
            keys=[self._meta_key(user_id)],
            args=[self.prefix, user_id, b"" if base is None else base.version, first_page, num_pages, version,
                  start_pos, length, bytes(tag), crc.tobytes(), layout.page_nbytes, self._capacity, self._ttl,
                  *sorted({int(u) for u in protect} - {user_id})],
            client=pipe,
        )
        reply = pipe.execute()[-1]
        if reply[0] == b"conflict":
            self.stats.conflicts += 1
        if reply[0] != b"ok":
            return HostWriteResult(False, ())
        victims = reply[1:]
        evicted = tuple(
            (int(victims[i]), HostEntry(int(victims[i + 1]), int(victims[i + 2]), victims[i + 3] or b""))
            for i in range(0, len(victims), 4)
        )
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

    def _parse(self, user_id: int, raw: dict[bytes, bytes]) -> _Meta:
        try:
            return _Meta.parse(raw, self.layout)
        except TierDataError as exc:
            self.stats.bad_reads += 1
            self.drop(user_id)  # would fail every later read and write of the user otherwise
            raise TierDataError(f"user {user_id}: {exc}; the entry was dropped.") from exc

    def _staging_pages(self, n: int) -> Tensor:
        """A reused host buffer for `n` pages: written by `fill`, readable until the next write."""
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = torch.empty((n, *self.layout.page_shape), dtype=self.layout.dtype)
        return self._staging[:n]

    def _decode(self, user_id: int, meta: _Meta, blobs: list[bytes]) -> Tensor:
        """Checked bytes -> [pages, *page_shape] with one copy per page (no per-element work)."""
        layout = self.layout
        out = torch.empty((len(blobs), *layout.page_shape), dtype=layout.dtype)
        rows = out.view(torch.uint8).numpy().reshape(len(blobs), layout.page_nbytes)
        for i, blob in enumerate(blobs):
            if len(blob) != layout.page_nbytes or zlib.crc32(blob) != meta.crc[i]:
                self.stats.bad_reads += 1
                self._drop(keys=[self._meta_key(user_id)], args=[self.prefix, user_id, meta.version])
                raise TierDataError(
                    f"user {user_id}: page {i} of version {meta.version.decode()} has {len(blob)} bytes "
                    f"(expected {layout.page_nbytes}) or a wrong checksum; the entry was dropped."
                )
            rows[i] = np.frombuffer(blob, dtype=np.uint8)
        return out
