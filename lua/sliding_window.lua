--[[
sliding_window.lua - the sliding-window-log rate limiter, with weights. This file is
the only copy of the algorithm: the build embeds it in the C extension.

KEYS[i]    (i = 1..n) one sorted set per window, shortest window first
           (score = request time in unix ms, member = UUID4 text)
KEYS[n+i]  the weights of KEYS[i]: a hash {member -> cost} of its entries whose cost is
           not 1, and field "" = the sum of (cost - 1) over them. It exists only while
           such an entry does, so a window of plain entries costs one HGET more.
ARGV[1]    the member to add when every window allows
ARGV[2]    the request time in unix ms, or "" to read the server's clock (TIME)
ARGV[3i], ARGV[3i+1], ARGV[3i+2]
           window length in ms, limit and cost of KEYS[i] (limit and cost in cost units)
ARGV[3n+3] optional: "1" marks a replay of a call whose reply was lost. If the member is
           already logged in KEYS[n] (the longest window, where it stays longest), the
           first attempt was allowed and logged: answer allow again, write nothing.

used(i) = ZCARD(KEYS[i]) + weights "" field: the sum of the costs in the window.

Returns {allowed, remaining, retry_after_s, i, now_ms, {remaining per window}, retry_ms}:
  allow  -> {1, fewest remaining over all windows after this request, 0,
             index of that window (ties: the shorter), now, {limit - used - cost ...}, 0}
  reject -> {0, 0, max(1, ceil(wait / 1000)), index of the rejecting window, now,
             {limit - used of the windows before it ..., 0}, max(1, wait)},
             where wait = score_k + window_ms - now and entry k is the oldest entry whose
             leaving frees enough: the costs of the entries up to it add up to
             used + cost - limit.
A rejection writes nothing, and no key after the rejecting window is touched.

A Redis over its maxmemory refuses the script with an OOM error before it writes
anything (see the probe below), rather than admitting requests it cannot log.
--]]

-- Redis refuses a command that may grow memory (ZADD) under OOM only while the
-- script has written nothing yet: a trim that removed an entry would let every
-- later ZADD through. So one such command goes first, one that changes nothing
-- (XX: only existing members; "" is never a member): over maxmemory it fails
-- the whole script with -OOM, and nothing was written.
redis.call('ZADD', KEYS[1], 'XX', 0, '')

local n = #KEYS / 2

local now = tonumber(ARGV[2])
if not now then
  -- Redis before 7.0 must be told to replicate effects once the script read TIME.
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Drops the entries that left window i; returns its used cost and its weights' total.
local function trim(i, window_ms)
  local key, weights = KEYS[i], KEYS[n + i]
  local extra = tonumber(redis.call('HGET', weights, ''))
  if extra then
    -- Weighted entries may be leaving: take their weight off the total first.
    -- In batches: Lua's unpack() takes a few thousand values at most.
    local freed = 0
    local leaving = redis.call('ZCOUNT', key, '-inf', now - window_ms)
    for from = 0, leaving - 1, 1000 do
      local last = from + 999
      if last >= leaving then last = leaving - 1 end
      local gone = redis.call('ZRANGE', key, from, last)
      local costs = redis.call('HMGET', weights, unpack(gone))
      local weighted = {}
      for j = 1, #gone do
        if costs[j] then
          freed = freed + tonumber(costs[j]) - 1
          weighted[#weighted + 1] = gone[j]
        end
      end
      if #weighted > 0 then redis.call('HDEL', weights, unpack(weighted)) end
    end
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
  return redis.call('ZCARD', key) + extra, extra
end

-- Seconds and milliseconds until enough of window i's oldest entries leave to free
-- `need` units.
local function retry_after(i, window_ms, need, extra)
  local key, weights = KEYS[i], KEYS[n + i]
  local score
  if extra == 0 then
    -- Every entry costs 1: the need-th oldest is the one.
    score = redis.call('ZRANGE', key, need - 1, need - 1, 'WITHSCORES')[2]
  else
    local freed, from = 0, 0
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
  -- No entry frees enough (only a cost above the limit, which the client refuses): the
  -- whole window must pass.
  local wait = score and tonumber(score) + window_ms - now or window_ms
  if wait < 1 then wait = 1 end
  return math.ceil(wait / 1000), wait
end

local fewest, fewest_index = nil, 1
local remaining_of = {}

if ARGV[3 * n + 3] == '1' and redis.call('ZSCORE', KEYS[n], ARGV[1]) then
  -- Already counted by the first attempt: report, write nothing.
  for i = 1, n do
    local used = trim(i, tonumber(ARGV[3 * i]))
    local remaining = tonumber(ARGV[3 * i + 1]) - used
    if remaining < 0 then remaining = 0 end
    remaining_of[i] = remaining
    if fewest == nil or remaining < fewest then
      fewest, fewest_index = remaining, i
    end
  end
  return {1, fewest, 0, fewest_index, now, remaining_of, 0}
end

for i = 1, n do
  local window_ms = tonumber(ARGV[3 * i])
  local limit = tonumber(ARGV[3 * i + 1])
  local cost = tonumber(ARGV[3 * i + 2])
  local used, extra = trim(i, window_ms)
  if used + cost > limit then
    -- Nothing is charged: the windows before this one keep what they had.
    for j = 1, i - 1 do remaining_of[j] = remaining_of[j] + tonumber(ARGV[3 * j + 2]) end
    remaining_of[i] = 0
    local retry, wait = retry_after(i, window_ms, used + cost - limit, extra)
    return {0, 0, retry, i, now, remaining_of, wait}
  end
  local remaining = limit - used - cost
  remaining_of[i] = remaining
  if fewest == nil or remaining < fewest then
    fewest, fewest_index = remaining, i
  end
end

for i = 1, n do
  local seconds = tonumber(ARGV[3 * i]) / 1000 + 1
  local cost = tonumber(ARGV[3 * i + 2])
  redis.call('ZADD', KEYS[i], now, ARGV[1])
  redis.call('EXPIRE', KEYS[i], seconds)
  if cost ~= 1 then
    local weights = KEYS[n + i]
    redis.call('HSET', weights, ARGV[1], cost)
    redis.call('HINCRBY', weights, '', cost - 1)
    redis.call('EXPIRE', weights, seconds)
  end
end
return {1, fewest, 0, fewest_index, now, remaining_of, 0}
