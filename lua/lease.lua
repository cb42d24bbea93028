--[[
lease.lua - in-flight leases: at most `limit` concurrent holders per user, each slot
given back by release or, when its holder never comes back (process killed, connection
lost), by its own expiry. This file is the only copy of the algorithm: the build embeds
it in the C extension.

KEYS[1]    the user's leases: a sorted set {lease id (UUID4 text) -> expiry, unix ms}
ARGV[1]    "acquire", "release" or "renew"
ARGV[2]    the lease id: a fresh UUID4 for acquire, the lease's own for release / renew
ARGV[3]    now in unix ms, or "" to read the server's clock (TIME)
ARGV[4]    acquire: the limit (concurrent holders); otherwise ignored
ARGV[5]    acquire / renew: the lease's length in ms; otherwise ignored
ARGV[6]    optional: "1" marks a replay after a lost reply. Ignored: every operation is
           idempotent by itself. acquire with a lease id already held answers "admitted"
           again, release removes at most once, renew of a held lease extends it again.

Expired leases (expiry <= now) are dropped first, by every operation.

Returns {ok, held, retry_ms, expires_ms, now_ms}:
  acquire allowed  -> {1, holders after this one, 0, this lease's expiry, now}
  acquire refused  -> {0, holders, max(1, soonest expiry - now), 0, now}: the wait until
                      the soonest lease expires, an upper bound (a holder that releases
                      frees its slot sooner). Nothing is written.
  release          -> {1 if the lease was held, holders after, 0, 0, now}
  renew            -> {1, holders, 0, new expiry, now} when the lease is still held,
                      {0, holders, 0, 0, now} when it expired or was released: a lease
                      whose slot may have gone to someone else never comes back.
The key expires with its latest lease (PEXPIRE, relative: right whichever clock decides).
--]]

local key, op, id = KEYS[1], ARGV[1], ARGV[2]

if op ~= 'release' then
  -- The OOM probe of sliding_window.lua: over maxmemory the script fails before it
  -- writes anything. Release has none: it only frees memory and must work then too.
  redis.call('ZADD', key, 'XX', 0, '')
end

local now = tonumber(ARGV[3])
if not now then
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', now)

-- The key lives as long as its latest lease.
local function keep_until_latest()
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')[2]
  if latest then
    local ttl = tonumber(latest) - now
    if ttl < 1 then ttl = 1 end
    redis.call('PEXPIRE', key, ttl)
  end
end

if op == 'release' then
  local removed = redis.call('ZREM', key, id)
  return {removed, redis.call('ZCARD', key), 0, 0, now}
end

local lease_ms = tonumber(ARGV[5])
local held = redis.call('ZSCORE', key, id)

if op == 'renew' then
  if not held then
    return {0, redis.call('ZCARD', key), 0, 0, now}
  end
  local expires = now + lease_ms
  redis.call('ZADD', key, 'XX', expires, id)
  keep_until_latest()
  return {1, redis.call('ZCARD', key), 0, expires, now}
end

-- acquire
if held then
  -- The first attempt admitted this very lease (its reply was lost): admitted again.
  return {1, redis.call('ZCARD', key), 0, tonumber(held), now}
end
local count = redis.call('ZCARD', key)
if count >= tonumber(ARGV[4]) then
  local soonest = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2])
  local wait = soonest - now
  if wait < 1 then wait = 1 end
  return {0, count, wait, 0, now}
end
local expires = now + lease_ms
redis.call('ZADD', key, expires, id)
keep_until_latest()
return {1, count + 1, 0, expires, now}
