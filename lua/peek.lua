--[[
peek.lua - what sliding_window.lua would answer now, without writing anything: no trim,
no entry, no TTL. Read-only (only reads and TIME), so it runs on a replica's EVALSHA too.

KEYS, ARGV  exactly sliding_window.lua's (ARGV[1], the member, is ignored, and so is the
            replay marker: a peek is answered the same however often it is sent).

The trim of sliding_window.lua is not done but accounted for: an entry at or before
now - window_ms counts as gone, and so does its weight. So the answer equals the one a
check with the same windows and costs would give at the same instant.

Returns sliding_window.lua's 7 elements, computed the same way (an allow reports every
window's remaining after a request of the given cost; a reject stops at the rejecting
window), and an 8th: {used_1, oldest_1, ..., used_n, oldest_n} for every window, where
used is the cost logged in the window and oldest the time (unix ms) of its oldest entry
still in it, or -1 when it is empty.
--]]

local n = #KEYS / 2

local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Window i as sliding_window.lua's trim would leave it: {used, extra, gone}, where gone
-- is the number of entries the trim would drop (the first ones by rank).
local function look(i, window_ms)
  local key, weights = KEYS[i], KEYS[n + i]
  local gone = redis.call('ZCOUNT', key, '-inf', now - window_ms)
  local extra = tonumber(redis.call('HGET', weights, ''))
  if extra then
    local freed = 0
    for from = 0, gone - 1, 1000 do
      local last = from + 999
      if last >= gone then last = gone - 1 end
      local leaving = redis.call('ZRANGE', key, from, last)
      local costs = redis.call('HMGET', weights, unpack(leaving))
      for j = 1, #leaving do
        if costs[j] then freed = freed + tonumber(costs[j]) - 1 end
      end
    end
    extra = extra - freed
    if extra < 0 then extra = 0 end
  else
    extra = 0
  end
  return redis.call('ZCARD', key) - gone + extra, extra, gone
end

-- sliding_window.lua's retry_after, on the entries after the `gone` first ones.
local function retry_after(i, window_ms, need, extra, gone)
  local key, weights = KEYS[i], KEYS[n + i]
  local score
  if extra == 0 then
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
  local wait = score and tonumber(score) + window_ms - now or window_ms
  if wait < 1 then wait = 1 end
  return math.ceil(wait / 1000), wait
end

local usage = {}
local looked = {}
for i = 1, n do
  local used, extra, gone = look(i, tonumber(ARGV[3 * i]))
  looked[i] = {used, extra, gone}
  local oldest = redis.call('ZRANGE', KEYS[i], gone, gone, 'WITHSCORES')[2]
  usage[2 * i - 1] = used
  usage[2 * i] = oldest and tonumber(oldest) or -1
end

local fewest, fewest_index = nil, 1
local remaining_of = {}
for i = 1, n do
  local window_ms = tonumber(ARGV[3 * i])
  local limit = tonumber(ARGV[3 * i + 1])
  local cost = tonumber(ARGV[3 * i + 2])
  local used, extra, gone = looked[i][1], looked[i][2], looked[i][3]
  if used + cost > limit then
    for j = 1, i - 1 do remaining_of[j] = remaining_of[j] + tonumber(ARGV[3 * j + 2]) end
    remaining_of[i] = 0
    local retry, wait = retry_after(i, window_ms, used + cost - limit, extra, gone)
    return {0, 0, retry, i, now, remaining_of, wait, usage}
  end
  local remaining = limit - used - cost
  remaining_of[i] = remaining
  if fewest == nil or remaining < fewest then
    fewest, fewest_index = remaining, i
  end
end
return {1, fewest, 0, fewest_index, now, remaining_of, 0, usage}
