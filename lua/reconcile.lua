--[[
reconcile.lua - sets the cost of one logged entry to what the request really cost
(reserve -> reconcile). The keys are the same as sliding_window.lua's.

KEYS[i]    (i = 1..n) the sorted sets the entry was logged in
KEYS[n+i]  the weights of KEYS[i] (see sliding_window.lua)
ARGV[1]    the entry's member
ARGV[2]    the entry's score (the reservation's time, unix ms)
ARGV[3]    the entry's new cost, an integer >= 0 (0 removes the entry)
ARGV[4]    now in unix ms, or "" to read the server's clock (TIME)
ARGV[4+i]  window length in ms of KEYS[i]

In every window where the entry is still present with that score and has not yet left
the window, its cost becomes ARGV[3]: a lower cost refunds, a higher one charges (used
may go above the limit: later requests wait longer; nothing is undone), 0 removes it.
Setting the same cost twice changes nothing, so a replay after a lost reply is safe.

Returns the number of windows whose entry was found (0 when it has left them all).
--]]

-- The OOM probe of sliding_window.lua: over maxmemory the script fails before any write.
redis.call('ZADD', KEYS[1], 'XX', 0, '')

local n = #KEYS / 2
local member, score, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

local now = tonumber(ARGV[4])
if not now then
  if redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local found = 0
for i = 1, n do
  local key, weights = KEYS[i], KEYS[n + i]
  local logged = tonumber(redis.call('ZSCORE', key, member))
  if logged == score and score > now - tonumber(ARGV[4 + i]) then
    found = found + 1
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
  end
end
return found
