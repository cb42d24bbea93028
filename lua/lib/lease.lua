--[[
lib/lease.lua - in-flight leases of one user (see lease.lua): at most `limit` concurrent
holders, each slot given back by release or by its own expiry. Prepended by the build
(setup.py) to the scripts that name it; functions only.

The leases key is a sorted set {lease id (UUID4 text) -> expiry, unix ms}. Expired leases
(expiry <= now) are dropped first, by every operation. The key expires with its latest
lease (PEXPIRE, relative: right whichever clock decides).

The stats key beside it ({prefix}:{user}:leases:stats) is a hash that tells a refused caller
when a slot is likely to free:
  <lease id>  the start (unix ms) of each held lease; dropped with its lease
  hold_ms     a decayed mean of the hold times of released leases (ms): each release weighs
              1/holds of it, then 1/HOLD_WEIGHT_TURNS once that many were
  hold_sq     the same decayed mean of their squares (ms^2)
  holds       how many holds the means are made of (up to HOLD_WEIGHT_TURNS)
A lease that expired unreleased adds no hold (its holder never told how long it ran). The
key expires STATS_IDLE_MS after the latest lease (an idle user's history is forgotten).

The hold a refused caller waits for is one it finds in flight, and a long request is in
flight longer, so more likely found there than a short one: its expected length is the
length-weighted mean, hold_sq / hold_ms (the plain mean when every hold is the same). Slots
given back at once (a request a window refused after it took its slot, a caller cancelled
before the reply) weigh almost nothing in it, where they would drag a plain mean to zero.
--]]

-- The refusal's hint (ms): the expected hold less how long the oldest held request has run,
-- at least a quarter of the expected hold (an overdue request may run on) and HINT_MIN_MS,
-- at most HINT_MAX_MS (the longest Retry-After the openai and anthropic SDKs act on) and the
-- soonest lease's expiry. With no history: HINT_NO_HISTORY_MS, so the SDKs' two default
-- retries span 10 s, a typical completion stream.
local HINT_NO_HISTORY_MS = 5000
local HINT_MIN_MS = 1000
local HINT_MAX_MS = 60000
local HOLD_WEIGHT_TURNS = 4
local STATS_IDLE_MS = 3600000

-- The leases a call reads at once (soonest expiry first): when that is all of them, as under
-- any in-flight limit below it, the operations below need no other read of the set.
local LEASES_READ = 64

-- The leases in `key` at `now`, expired ones dropped; `stats` is the key of their starts
-- and hold history.
local function leases(key, stats, now)
  local held = {}
  local first = redis.call('ZRANGE', key, 0, LEASES_READ - 1, 'WITHSCORES')
  -- listed: every lease was read; live: then the ones held, {id, expiry, ...}, kept up to
  -- date by the operations below (else they ask the set).
  local listed, expired, live = #first < 2 * LEASES_READ, {}, {}
  if listed then
    for j = 1, #first, 2 do
      local expiry = tonumber(first[j + 1])
      if expiry <= now then
        expired[#expired + 1] = first[j]
      else
        live[#live + 1] = first[j]
        live[#live + 1] = expiry
      end
    end
  else
    expired = redis.call('ZRANGEBYSCORE', key, '-inf', now)
  end
  -- how many expired leases were dropped: slots freed (lib/queue.lua's queue_wake)
  held.dropped = #expired
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    for i = 1, #expired, 1000 do
      redis.call('HDEL', stats, unpack(expired, i, math.min(i + 999, #expired)))
    end
  end

  -- The expiry of lease `id` when it is held, else nil.
  local function expiry_of(id)
    if not listed then return tonumber(redis.call('ZSCORE', key, id)) end
    for j = 1, #live, 2 do
      if live[j] == id then return live[j + 1] end
    end
    return nil
  end

  -- Sets (or, expiry nil, removes) lease `id` in `live`.
  local function note(id, expiry)
    if not listed then return end
    for j = 1, #live, 2 do
      if live[j] == id then
        if expiry then
          live[j + 1] = expiry
        else
          table.remove(live, j)
          table.remove(live, j)
        end
        return
      end
    end
    if expiry then
      live[#live + 1] = id
      live[#live + 1] = expiry
    end
  end

  -- The soonest (`latest` false) or the latest expiry of the held leases, nil when none.
  local function expiry_bound(latest)
    if not listed then
      local at = latest and -1 or 0
      return tonumber(redis.call('ZRANGE', key, at, at, 'WITHSCORES')[2])
    end
    local found = nil
    for j = 2, #live, 2 do
      local expiry = live[j]
      if not found or (latest and expiry > found) or (not latest and expiry < found) then
        found = expiry
      end
    end
    return found
  end

  -- The key lives as long as its latest lease; the stats an hour longer.
  local function keep_until_latest()
    local latest = expiry_bound(true)
    local ttl = 0
    if latest then
      ttl = latest - now
      if ttl < 1 then ttl = 1 end
      redis.call('PEXPIRE', key, ttl)
    end
    redis.call('PEXPIRE', stats, ttl + STATS_IDLE_MS)
  end

  -- The wait a refused caller is told (see HINT_*), never past `bound`, the soonest expiry.
  -- The starts are read with HMGET (the commands docs/security.md's ACL allows), in steps
  -- that keep unpack within Lua's stack.
  local function hint(bound)
    local history = redis.call('HMGET', stats, 'hold_ms', 'hold_sq')
    local mean, square = tonumber(history[1]), tonumber(history[2])
    local wait = HINT_NO_HISTORY_MS
    if mean and square then
      local expected = 0
      if mean > 0 then expected = square / mean end
      local ids, oldest = {}, now
      if listed then
        for j = 1, #live, 2 do ids[#ids + 1] = live[j] end
      else
        ids = redis.call('ZRANGE', key, 0, -1)
      end
      for i = 1, #ids, 1000 do
        local starts = redis.call('HMGET', stats, unpack(ids, i, math.min(i + 999, #ids)))
        for j = 1, #starts do
          local start = tonumber(starts[j])
          if start and start < oldest then oldest = start end
        end
      end
      wait = math.max(expected - (now - oldest), expected / 4, HINT_MIN_MS)
    end
    wait = math.floor(math.min(wait, HINT_MAX_MS, bound))
    if wait < 1 then wait = 1 end
    return wait
  end

  -- Whether `id` may take a slot of `limit`, without writing: {1, holders after it, 0,
  -- its expiry if it is already held (a replay) or 0, 0} or {0, holders, the hint (>= 1),
  -- 0, the wait until the soonest lease expires (>= the hint)}. `fresh`: the caller knows
  -- `id` is not held (a fresh UUID4, not a replay), so it is not looked up. `gate`, when
  -- given, is a rule beside the count (lib/shares.lua's reserved shares): asked once the
  -- cap has room, gate(count) answers nil to admit, or true and the expiry that frees a
  -- slot for the caller (nil: the soonest lease's).
  function held.may_acquire(id, limit, fresh, gate)
    local expires = nil
    if not fresh then expires = expiry_of(id) end
    local count = held.count()
    if expires then
      -- The first attempt admitted this very lease (its reply was lost): admitted again.
      return {1, count, 0, expires, 0}
    end
    if count >= limit then
      local soonest = expiry_bound(false)
      local bound = soonest - now
      if bound < 1 then bound = 1 end
      return {0, count, hint(bound), 0, bound}
    end
    if gate then
      local refused, frees = gate(count)
      if refused then
        local bound = (frees or expiry_bound(false)) - now
        if bound < 1 then bound = 1 end
        return {0, count, hint(bound), 0, bound}
      end
    end
    return {1, count + 1, 0, 0, 0}
  end

  -- Takes the slot may_acquire allowed (nothing when it was already held): its expiry.
  function held.take(id, lease_ms, answer)
    if answer[4] ~= 0 then return answer[4] end
    local expires = now + lease_ms
    redis.call('ZADD', key, expires, id)
    note(id, expires)
    redis.call('HSET', stats, id, now)
    keep_until_latest()
    return expires
  end

  -- Gives `id`'s slot back: 1 when it was held, else 0. The removal comes first: it only
  -- frees memory, so a Redis over its maxmemory takes the writes after it too.
  function held.release(id)
    local removed = redis.call('ZREM', key, id)
    if removed == 0 then return 0 end
    note(id, nil)
    -- The start and the history in one read.
    local stored = redis.call('HMGET', stats, id, 'hold_ms', 'hold_sq', 'holds')
    local start = tonumber(stored[1])
    if start then
      redis.call('HDEL', stats, id)
      local hold = now - start
      if hold < 0 then hold = 0 end
      local mean, square = tonumber(stored[2]), tonumber(stored[3])
      local holds = tonumber(stored[4]) or 0
      if not (mean and square) then mean, square, holds = 0, 0, 0 end
      if holds < HOLD_WEIGHT_TURNS then holds = holds + 1 end
      mean = mean + (hold - mean) / holds
      square = square + (hold * hold - square) / holds
      redis.call('HSET', stats, 'hold_ms', string.format('%.17g', mean),
                 'hold_sq', string.format('%.17g', square), 'holds', holds)
    end
    keep_until_latest()
    return 1
  end

  -- Extends `id` to now + lease_ms when it is still held: its new expiry, or nil.
  function held.renew(id, lease_ms)
    if not expiry_of(id) then return nil end
    local expires = now + lease_ms
    redis.call('ZADD', key, 'XX', expires, id)
    note(id, expires)
    keep_until_latest()
    return expires
  end

  function held.count()
    if listed then return #live / 2 end
    return redis.call('ZCARD', key)
  end

  return held
end
