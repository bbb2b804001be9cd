"""The Redis tier's Lua scripts: one atomic step each for a write's commit, a read's meta and a drop.

Keys and their layout: kvcache/storage/redis_tier.py's docstring and docs/kvcache.md, "Redis tier".
"""
from __future__ import annotations

# Lua helpers shared by the scripts. Page keys are built here and in `RedisHostStorage._page_key`:
# keep the two formats identical.
LUA_COMMON = """
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
COMMIT = LUA_COMMON + """
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
READ_META = LUA_COMMON + """
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
DROP = LUA_COMMON + """
if redis.call('EXISTS', KEYS[1]) == 1 and not is_meta(KEYS[1]) then forget(ARGV[1], ARGV[2]); return 1 end
local version = redis.call('HGET', KEYS[1], 'version')
if ARGV[3] ~= '' and version ~= ARGV[3] then return 0 end
forget(ARGV[1], ARGV[2])
if version then return 1 end
return 0
"""
