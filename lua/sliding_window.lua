--[[
sliding_window.lua - the sliding-window-log rate limiter. This file is the
only copy of the algorithm: the build embeds it in the C extension.

KEYS[i]   one sorted set per window, shortest window first
          (score = request time in unix ms, member = UUID4 text)
ARGV[1]   the member to add when every window allows
ARGV[2]   the request time in unix ms, or "" to read the server's clock (TIME)
ARGV[2i+1], ARGV[2i+2]
          window length in ms and limit of KEYS[i]
ARGV[2n+3] optional: "1" marks a replay of a call whose reply was lost (n = #KEYS).
          If the member is already logged in KEYS[n] (the longest window, where it
          stays longest), the first attempt was allowed and logged: answer allow
          again without logging twice.

Returns {allowed, remaining, retry_after_s, i}:
  allow  -> {1, fewest remaining over all windows after this request, 0,
             index of that window (ties: the shorter)}
  reject -> {0, 0, max(1, ceil((score_k + window_ms - now) / 1000)), index of
             the rejecting window}, where score_k is the score of the entry
             whose expiry first brings the count below the limit.
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

local now = tonumber(ARGV[2])
if not now then
  -- Redis before 7.0 must be told to replicate effects once the script read TIME.
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local fewest, fewest_index = nil, 1

if ARGV[2 * #KEYS + 3] == '1' and redis.call('ZSCORE', KEYS[#KEYS], ARGV[1]) then
  -- Already counted by the first attempt: report, write nothing.
  for i = 1, #KEYS do
    local window_ms = tonumber(ARGV[2 * i + 1])
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now - window_ms)
    local remaining = tonumber(ARGV[2 * i + 2]) - redis.call('ZCARD', KEYS[i])
    if remaining < 0 then remaining = 0 end
    if fewest == nil or remaining < fewest then
      fewest, fewest_index = remaining, i
    end
  end
  return {1, fewest, 0, fewest_index}
end
for i = 1, #KEYS do
  local key = KEYS[i]
  local window_ms = tonumber(ARGV[2 * i + 1])
  local limit = tonumber(ARGV[2 * i + 2])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window_ms)
  local count = redis.call('ZCARD', key)
  if count >= limit then
    -- The (count - limit)-th entry (0-based) is the one whose expiry brings
    -- the count below the limit: the oldest when the window is exactly full.
    local k = count - limit
    local entry = redis.call('ZRANGE', key, k, k, 'WITHSCORES')
    local retry = math.ceil((tonumber(entry[2]) + window_ms - now) / 1000)
    if retry < 1 then retry = 1 end
    return {0, 0, retry, i}
  end
  local remaining = limit - count - 1
  if fewest == nil or remaining < fewest then
    fewest, fewest_index = remaining, i
  end
end

for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], now, ARGV[1])
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[2 * i + 1]) / 1000 + 1)
end
return {1, fewest, 0, fewest_index}
