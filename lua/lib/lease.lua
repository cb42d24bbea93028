--[[
lib/lease.lua - in-flight leases of one user (see lease.lua): at most `limit` concurrent
holders, each slot given back by release or by its own expiry. Prepended by the build
(setup.py) to the scripts that name it; functions only.

The leases key is a sorted set {lease id (UUID4 text) -> expiry, unix ms}. Expired leases
(expiry <= now) are dropped first, by every operation. The key expires with its latest
lease (PEXPIRE, relative: right whichever clock decides).
--]]

-- The leases in `key` at `now`, expired ones dropped.
local function leases(key, now)
  local held = {}
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

  -- Whether `id` may take a slot of `limit`, without writing: {1, holders after it, 0,
  -- its expiry if it is already held (a replay) or 0} or {0, holders, wait until the
  -- soonest lease expires (>= 1), 0}.
  function held.may_acquire(id, limit)
    local expires = redis.call('ZSCORE', key, id)
    local count = redis.call('ZCARD', key)
    if expires then
      -- The first attempt admitted this very lease (its reply was lost): admitted again.
      return {1, count, 0, tonumber(expires)}
    end
    if count >= limit then
      local soonest = tonumber(redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2])
      local wait = soonest - now
      if wait < 1 then wait = 1 end
      return {0, count, wait, 0}
    end
    return {1, count + 1, 0, 0}
  end

  -- Takes the slot may_acquire allowed (nothing when it was already held): its expiry.
  function held.take(id, lease_ms, answer)
    if answer[4] ~= 0 then return answer[4] end
    local expires = now + lease_ms
    redis.call('ZADD', key, expires, id)
    keep_until_latest()
    return expires
  end

  -- Gives `id`'s slot back: 1 when it was held, else 0.
  function held.release(id)
    return redis.call('ZREM', key, id)
  end

  -- Extends `id` to now + lease_ms when it is still held: its new expiry, or nil.
  function held.renew(id, lease_ms)
    if not redis.call('ZSCORE', key, id) then return nil end
    local expires = now + lease_ms
    redis.call('ZADD', key, 'XX', expires, id)
    keep_until_latest()
    return expires
  end

  function held.count()
    return redis.call('ZCARD', key)
  end

  return held
end
