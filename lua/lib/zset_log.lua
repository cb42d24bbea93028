--[[
lib/zset_log.lua - the sliding-window log kept in sorted sets (storage "zset", the
default). Prepended by the build (setup.py) to the scripts that name it; functions only.

KEYS[i]    (i = 1..n) window i's sorted set {UUID4 member -> request time, unix ms}
KEYS[n+i]  its weights: a hash {member -> cost} of its entries whose cost is not 1, and
           field "" = the sum of (cost - 1) over them. It exists only while such an entry
           does, so a window of plain entries costs one HGET more.

used = ZCARD + the weights' "" field: the sum of the costs in the window. An entry at or
before now - window_ms has left the window.
--]]

-- The log of a call's n windows at `now`: functions over KEYS[i] and KEYS[n + i], with
-- what the last measure of each window found kept for freeing_stamp.
local function zset_log(n, now)
  local log = {}
  -- Per window measured: the weights' total after the measure, and how many of the first
  -- entries (by rank) have left the window but are still in the set (peek: 0 after trim).
  local extra_of, gone_of = {}, {}

  -- The weights' total of the `count` entries from rank `from`; removes their weights
  -- when `drop` (the entries are being trimmed). In batches: Lua's unpack() takes a few
  -- thousand values at most.
  local function weights_of_first(i, count, drop)
    local key, weights = KEYS[i], KEYS[n + i]
    local freed = 0
    for from = 0, count - 1, 1000 do
      local last = from + 999
      if last >= count then last = count - 1 end
      local leaving = redis.call('ZRANGE', key, from, last)
      local costs = redis.call('HMGET', weights, unpack(leaving))
      local weighted = {}
      for j = 1, #leaving do
        if costs[j] then
          freed = freed + tonumber(costs[j]) - 1
          weighted[#weighted + 1] = leaving[j]
        end
      end
      if drop and #weighted > 0 then redis.call('HDEL', weights, unpack(weighted)) end
    end
    return freed
  end

  -- Drops the entries that left window i; returns its used cost.
  function log.trim(i, window_ms)
    local key, weights = KEYS[i], KEYS[n + i]
    local extra = tonumber(redis.call('HGET', weights, ''))
    if extra then
      -- Weighted entries may be leaving: take their weight off the total first.
      local freed = weights_of_first(i, redis.call('ZCOUNT', key, '-inf', now - window_ms), true)
      if freed > 0 then
        extra = extra - freed
        if extra > 0 then
          redis.call('HSET', weights, '', extra)
        else
          redis.call('HDEL', weights, '')
          extra = 0
        end
      end
    else
      extra = 0
    end
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window_ms)
    extra_of[i], gone_of[i] = extra, 0
    return redis.call('ZCARD', key) + extra
  end

  -- Window i as trim would leave it, without writing: {used, oldest entry's time or nil}.
  -- The entries at or before now - window_ms count as gone, and so do their weights.
  function log.look(i, window_ms)
    local key, weights = KEYS[i], KEYS[n + i]
    local gone = redis.call('ZCOUNT', key, '-inf', now - window_ms)
    local extra = tonumber(redis.call('HGET', weights, ''))
    if extra then
      extra = extra - weights_of_first(i, gone, false)
      if extra < 0 then extra = 0 end
    else
      extra = 0
    end
    extra_of[i], gone_of[i] = extra, gone
    local oldest = redis.call('ZRANGE', key, gone, gone, 'WITHSCORES')[2]
    return redis.call('ZCARD', key) - gone + extra, oldest and tonumber(oldest)
  end

  -- The time of window i's oldest entry (after the ones gone) whose leaving frees `need`
  -- units, or nil when none does. Uses what the last trim or look of window i found.
  function log.freeing_stamp(i, window_ms, need)
    local key, weights = KEYS[i], KEYS[n + i]
    local extra, gone = extra_of[i], gone_of[i]
    local score
    if extra == 0 then
      -- Every entry costs 1: the need-th oldest is the one.
      score = redis.call('ZRANGE', key, gone + need - 1, gone + need - 1, 'WITHSCORES')[2]
    else
      local freed, from = 0, gone
      while not score do
        local batch = redis.call('ZRANGE', key, from, from + 63, 'WITHSCORES')
        if #batch == 0 then break end
        local members = {}
        for j = 1, #batch, 2 do members[#members + 1] = batch[j] end
        local costs = redis.call('HMGET', weights, unpack(members))
        for j = 1, #members do
          freed = freed + (tonumber(costs[j]) or 1)
          if freed >= need then
            score = batch[2 * j]
            break
          end
        end
        from = from + 64
      end
    end
    return score and tonumber(score)
  end

  -- True when `member` is logged in window i (a replay whose first attempt counted).
  function log.holds(i, member)
    return redis.call('ZSCORE', KEYS[i], member) ~= false
  end

  -- Logs `member` at now in window i with `cost`; the keys live window_ms + 1 s.
  function log.add(i, member, cost, window_ms)
    local seconds = window_ms / 1000 + 1
    redis.call('ZADD', KEYS[i], now, member)
    redis.call('EXPIRE', KEYS[i], seconds)
    if cost ~= 1 then
      local weights = KEYS[n + i]
      redis.call('HSET', weights, member, cost)
      redis.call('HINCRBY', weights, '', cost - 1)
      redis.call('EXPIRE', weights, seconds)
    end
  end

  -- Sets the cost of the entry `member` logged at `score` in window i to `cost` (0
  -- removes it), when it is still there with that score and has not left the window.
  -- Returns 1 when it was, else 0. Setting the same cost twice changes nothing.
  function log.set_cost(i, member, score, cost, window_ms)
    local key, weights = KEYS[i], KEYS[n + i]
    local logged = tonumber(redis.call('ZSCORE', key, member))
    if logged ~= score or score <= now - window_ms then return 0 end
    local old = tonumber(redis.call('HGET', weights, member)) or 1
    if cost == 0 then
      redis.call('ZREM', key, member)
    end
    -- The weights hold (cost - 1) for every entry whose cost is not 1.
    local delta = (cost == 0 and 1 or cost) - old
    if cost == 0 or cost == 1 then
      redis.call('HDEL', weights, member)
    else
      redis.call('HSET', weights, member, cost)
    end
    if delta ~= 0 then
      local extra = redis.call('HINCRBY', weights, '', delta)
      if extra <= 0 then redis.call('HDEL', weights, '') end
    end
    if redis.call('EXISTS', weights) == 1 then
      -- Created or grown here: it must live as long as the entries it weighs.
      local ttl = redis.call('PTTL', key)
      if ttl > 0 then redis.call('PEXPIRE', weights, ttl) end
    end
    return 1
  end

  return log
end
