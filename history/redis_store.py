"""The shared history store: every node's events on one Redis server, so any node can serve any user.

    store = RedisHistoryStore.from_url("redis://10.0.0.5:6379/2")                 # keys under "hstu:history"
    store = RedisHistoryStore.from_url(url, namespace="staging:history")         # another store, same server
    store.append(EventBatch.from_records([{"user_id": 7, "video_id": 12, "time_ms": 1650000000000}]))
    # -> AppendResult(appended=1, duplicates=0, late=0)

The server:
* **One Redis server, not Redis Cluster.** An append is one Lua script that touches the keys of every
  user and video of its batch; that is what makes it atomic, and Cluster forbids it across slots.
* **Durability.** An acknowledged append must survive a crash, so the server must run with
  `appendonly yes` and `appendfsync always`: Redis then fsyncs the AOF before it replies (Redis 7.0
  has no WAITAOF to ask for it per call). The constructor checks both with CONFIG GET and refuses a
  server without them; `require_fsync=False` skips the check, and then an acknowledged append may be
  lost when the server crashes. A server switched away from them at run time is noticed within
  `fsync_check_interval_s`, and its appends refused (history/redis_durability.py).
* **Memory.** About 400 bytes per event (its dedup key, its entry in the user's history, the video
  counters): 10M events take ~4 GB. benchmark/history/ingest.py measures it.
* **Time.** The script holds the server ~20-50 µs per event (while it runs, other clients wait), so
  keep appends to a few thousand events: 50,000 take 1-2 s.

Keys (`P` = the namespace; ids in decimal; "int64" packed big-endian):
    P:seq               arrival counter: an append takes one number per event (INCRBY)
    P:ukey:{user}       SET of the user's event keys (EVENT_KEY_COLUMNS but user_id, int64 each): the
                        dedup index, exact; SADD answers "is it new" in one command
    P:uev:{user}        ZSET score time_ms, member (time_ms, seq, video_id, action_weights) int64: members of
                        one score sort by seq, so a range read is the history in (time, arrival) order,
                        and the members alone decode to the arrays (one numpy call)
    P:v:shown:{video}   ZSET score time_ms, member seq: ZCOUNT is "shown before t"; P:v:{task}:{video}
                        the same for each counted action (data/schema.py COUNTED_TASKS)
    P:users  SET of users with events   P:events  number of events   P:manifest  manifest JSON
    P:batches  HASH batch_id -> digest + "appended,duplicates,late"   P:features  HASH user -> int64 LE blob

Atomicity: a Lua script runs alone and its effects reach the AOF as one MULTI/EXEC, so readers and a
restarted server see all of an append or none. Redis does not roll a failed script back, so the script
takes its own writes back (SREM/ZREM of what it added) when a command fails midway (a key of another
type in the namespace, written by something else); Redis refuses an out-of-memory script before its
first write. Failures raise `HistoryUnavailableError`, except an append sent and not answered (a
timeout): it may have been applied, whole, after all (a stalled server that resumes does), so it raises
`AppendOutcomeUnknownError`; retry it with the same batch_id to learn its result.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from data.event_rules import EVENT_KEY_COLUMNS
from data.manifest import Manifest
from data.schema import COUNTED_TASKS, TASKS
from data.user_histories import EventArrays
from history.base import AppendResult, BatchConflictError, HistoryStore, HistoryUnavailableError, batch_digest
from history.events import EventBatch
from history.redis_durability import DEFAULT_FSYNC_CHECK_INTERVAL_S, FsyncGuard, append_outcome

DEFAULT_NAMESPACE = "hstu:history"
_DEDUP_COLUMNS = [i for i, c in enumerate(EVENT_KEY_COLUMNS) if c != "user_id"]  # the user is in the key name
_COUNT_BITS = np.array([TASKS.index(t) for t in COUNTED_TASKS], dtype=np.int64)
_FEATURES_PER_COMMAND = 10_000

# ARGV: prefix, batch_id, digest ('' = no batch_id), counted tasks ("click,long_view"), dedup key width,
# then per event, in blobs (one argument each, whatever the batch size: redis-py packs every argument in
# Python, and that would dominate): dedup keys (width bytes each), member parts (time_ms, video_id,
# action_weights: 24 bytes), counted-task masks (1 byte), and "user time_ms video_id;" each in decimal.
# Returns {status, appended, duplicates, late}: status 'ok' | 'replayed' | 'conflict'.
_APPEND = """#!lua
local prefix, batch_id, digest = ARGV[1], ARGV[2], ARGV[3]
local width, keys, parts, masks = tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8]
local n = #masks
local batches = prefix .. ':batches'
if digest ~= '' then
  local seen = redis.call('HGET', batches, batch_id)
  if seen then
    if string.sub(seen, 1, #digest) ~= digest then return {'conflict', 0, 0, 0} end
    local a, d, l = string.match(string.sub(seen, #digest + 1), '^(%d+),(%d+),(%d+)$')
    return {'replayed', tonumber(a), tonumber(d), tonumber(l)}
  end
end
local counted = {}
for task in string.gmatch(ARGV[4], '[^,]+') do counted[#counted + 1] = task end
local base = redis.call('INCRBY', prefix .. ':seq', n) - n
local undo = {}  -- flat (command, key, value) triples that take this call's writes back
local function undo_by(command, key, value)
  local n_undo = #undo
  undo[n_undo + 1], undo[n_undo + 2], undo[n_undo + 3] = command, key, value
end
local function sadd(key, member)
  local new = redis.call('SADD', key, member)
  if new == 1 then undo_by('SREM', key, member) end
  return new
end
local function zadd(key, score, member)
  if redis.call('ZADD', key, score, member) == 1 then undo_by('ZREM', key, member) end
end
local latest, users, appended, late = {}, {}, 0, 0
local function append()
  local next_event = string.gmatch(ARGV[9], '(%d+) (%d+) (%d+);')
  for i = 1, n do
    local user, time, video = next_event()
    if latest[user] == nil then  -- the user's latest time before this call: read before its first write
      local last = redis.call('ZRANGE', prefix .. ':uev:' .. user, -1, -1, 'WITHSCORES')
      latest[user] = last[2] and tonumber(last[2]) or false
      users[#users + 1] = user
    end
    if sadd(prefix .. ':ukey:' .. user, string.sub(keys, (i - 1) * width + 1, i * width)) == 1 then
      local seq = struct.pack('>I8', base + i)
      local part = string.sub(parts, (i - 1) * 24 + 1, i * 24)
      zadd(prefix .. ':uev:' .. user, time, string.sub(part, 1, 8) .. seq .. string.sub(part, 9))
      zadd(prefix .. ':v:shown:' .. video, time, seq)
      local mask = string.byte(masks, i)
      for j = 1, #counted do
        if bit.band(mask, bit.lshift(1, j - 1)) ~= 0 then zadd(prefix .. ':v:' .. counted[j] .. ':' .. video, time, seq) end
      end
      appended = appended + 1
      if latest[user] and tonumber(time) < latest[user] then late = late + 1 end
    end
  end
  for _, user in ipairs(users) do sadd(prefix .. ':users', user) end
  redis.call('INCRBY', prefix .. ':events', appended)
  undo_by('DECRBY', prefix .. ':events', appended)
  if digest ~= '' then  -- the last write: nothing can fail after it
    redis.call('HSET', batches, batch_id, digest .. appended .. ',' .. (n - appended) .. ',' .. late)
  end
end
local ok, err = pcall(append)
if not ok then
  for j = #undo - 2, 1, -3 do redis.call(undo[j], undo[j + 1], undo[j + 2]) end
  return redis.error_reply('nothing stored: ' .. (type(err) == 'table' and err.err or tostring(err)))
end
return {'ok', appended, n - appended, late}
"""


class RedisHistoryStore(HistoryStore):
    def __init__(self, client: redis.Redis, namespace: str = DEFAULT_NAMESPACE, require_fsync: bool = True,
                 fsync_check_interval_s: float = DEFAULT_FSYNC_CHECK_INTERVAL_S) -> None:
        """A store on `client`'s server under `namespace` (closed with the store). `require_fsync`:
        refuse a server that does not fsync every write, at start and then before an append at most
        every `fsync_check_interval_s` (0: before every append; see the module docstring)."""
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisHistoryStore needs a client with decode_responses=False (it stores bytes)")
        self._client = client
        self.namespace = namespace
        self._append = client.register_script(_APPEND)  # EVALSHA, loaded again after a server restart
        self.durability = FsyncGuard(client, self.description, require_fsync, fsync_check_interval_s)

    @classmethod
    def from_url(cls, url: str, namespace: str = DEFAULT_NAMESPACE, require_fsync: bool = True,
                 timeout_s: float = 5.0, fsync_check_interval_s: float = DEFAULT_FSYNC_CHECK_INTERVAL_S
                 ) -> RedisHistoryStore:
        """`redis://[:password@]host:port/db`, `rediss://...` or `unix:///path?db=N`. Calls are not
        retried here: a retried append that was applied would report its events as duplicates."""
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0))
        return cls(client, namespace, require_fsync, fsync_check_interval_s)

    @property
    def description(self) -> str:
        kw = self._client.get_connection_kwargs()
        if "path" in kw:
            return f"unix://{kw['path']}?db={kw.get('db', 0)}"
        scheme = "rediss" if issubclass(self._client.connection_pool.connection_class, redis.SSLConnection) else "redis"
        return f"{scheme}://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"

    def _key(self, *parts: object) -> str:
        return ":".join([self.namespace, *map(str, parts)])

    @contextlib.contextmanager
    def _calling(self, what: str) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as err:
            raise HistoryUnavailableError(f"{self.description}: {what}: {err}") from err

    # ------------------------------------------------------------ writes
    def append(self, events: EventBatch, batch_id: str | None = None) -> AppendResult:
        if len(events) == 0 and batch_id is None:
            return AppendResult(0, 0, 0)
        key = events.key_columns
        masks = np.zeros(len(events), dtype=np.uint8)
        for j, bit in enumerate(_COUNT_BITS.tolist()):
            masks |= (((events.action_weights >> bit) & 1) << j).astype(np.uint8)
        parts = np.stack([events.time_ms, events.video_id, events.action_weights], axis=1)
        args = [
            self.namespace, batch_id or "", batch_digest(events) if batch_id is not None else b"",
            ",".join(COUNTED_TASKS), 8 * len(_DEDUP_COLUMNS),
            key[:, _DEDUP_COLUMNS].astype(">i8").tobytes(), parts.astype(">i8").tobytes(), masks.tobytes(),
            "".join(f"{u} {t} {v};" for u, t, v in zip(events.user_id.tolist(), events.time_ms.tolist(),
                                                         events.video_id.tolist())),
        ]
        self.durability.recheck()
        with append_outcome(self.description):
            status, appended, duplicates, late = self._append(args=args)
        if status == b"conflict":
            raise BatchConflictError(f"batch_id {batch_id!r} was used before for other events")
        return AppendResult(appended, duplicates, late, replayed=status == b"replayed")

    def set_user_features(self, user_ids: np.ndarray, features: np.ndarray) -> None:
        blobs = {int(u): np.asarray(f, dtype="<i8").tobytes() for u, f in zip(user_ids, features)}
        items = list(blobs.items())
        pipe = self._client.pipeline(transaction=True)  # all users or none
        for lo in range(0, len(items), _FEATURES_PER_COMMAND):
            pipe.hset(self._key("features"), mapping=dict(items[lo:lo + _FEATURES_PER_COMMAND]))
        with self._calling("writing user features failed, nothing stored"):
            pipe.execute()

    def put_manifest(self, manifest: Manifest) -> None:
        with self._calling("writing the manifest failed"):
            self._client.set(self._key("manifest"), manifest.to_json())

    # ------------------------------------------------------------ reads
    def read(self, user_ids: np.ndarray, until_ms: np.ndarray) -> EventArrays:
        users = np.asarray(user_ids, dtype=np.int64).reshape(-1)
        until = np.asarray(until_ms, dtype=np.int64).reshape(-1)
        pipe = self._client.pipeline(transaction=True)  # one consistent view of every user of the batch
        pipe.get(self._key("manifest"))
        pipe.hmget(self._key("features"), users.tolist() or [0])  # HMGET needs a field: a placeholder's is dropped
        for user, end in zip(users.tolist(), until.tolist()):
            pipe.zrangebyscore(self._key("uev", user), "-inf", f"({end}")
        with self._calling("read failed"):
            manifest_json, blobs, *histories = pipe.execute()
        self.read_round_trips += 1
        lengths = [len(members) for members in histories]
        # Each member is (time_ms, seq, video_id, action_weights) int64 big-endian, already in history order.
        flat = np.frombuffer(b"".join(m for members in histories for m in members), dtype=">i8").reshape(-1, 4)
        flat = flat.astype(np.int64)
        offsets = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        features = self._features(manifest_json, blobs[:len(users)])
        return EventArrays(users, offsets, flat[:, 2].copy(), flat[:, 3].copy(), flat[:, 0].copy(), features)

    def _features(self, manifest_json: bytes | None, blobs: list[bytes | None]) -> np.ndarray:
        """[U, F] from the users' blobs; F from the stored manifest (0 without one), unknown users 0."""
        width = 0 if manifest_json is None else len(self._manifest(manifest_json).user_features)
        out = np.zeros((len(blobs), width), dtype=np.int64)
        if width:
            for i, blob in enumerate(blobs):
                if blob is not None:
                    out[i] = np.frombuffer(blob, dtype="<i8")
        return out

    def counts(self, video_ids: np.ndarray, times_ms: np.ndarray) -> np.ndarray:
        videos = np.asarray(video_ids, dtype=np.int64).reshape(-1)
        times = np.asarray(times_ms, dtype=np.int64).reshape(-1)
        width = 1 + len(COUNTED_TASKS)
        if len(videos) == 0:
            return np.zeros((0, width), dtype=np.int64)
        keys, inverse = np.unique(np.stack([videos, times], axis=1), axis=0, return_inverse=True)
        pipe = self._client.pipeline(transaction=True)  # every counter as of one moment
        for video, time in keys.tolist():
            for counter in ("shown", *COUNTED_TASKS):
                pipe.zcount(self._key("v", counter, video), "-inf", f"({time}")
        with self._calling("counters read failed"):
            out = np.array(pipe.execute(), dtype=np.int64).reshape(len(keys), width)
        self.read_round_trips += 1
        return out[inverse.reshape(-1)]

    def stored_user_ids(self) -> np.ndarray:
        with self._calling("reading users failed"):
            members = self._client.smembers(self._key("users"))
        return np.sort(np.array([int(m) for m in members], dtype=np.int64))

    def num_events(self) -> int:
        with self._calling("reading the event count failed"):
            return int(self._client.get(self._key("events")) or 0)

    def get_manifest(self) -> Manifest | None:
        with self._calling("reading the manifest failed"):
            text = self._client.get(self._key("manifest"))
        return None if text is None else self._manifest(text)

    def _manifest(self, text: bytes) -> Manifest:
        return Manifest.from_json(text.decode(), source=f"{self.description} {self._key('manifest')}")

    def close(self) -> None:
        self._client.close()
