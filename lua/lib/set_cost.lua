--[[
lib/set_cost.lua - reconcile's work, the same for every storage: the cost of one logged
entry set to what the request really cost, in every window of the call. Prepended by the
build (setup.py) to the reconciling scripts; functions only.

ARGV[1]    the entry's member
ARGV[2]    the entry's time (the reservation's, unix ms)
ARGV[3]    the entry's new cost, an integer >= 0 (0 removes the entry)
ARGV[4]    now in unix ms, or "" to read the server's clock (TIME)
ARGV[5]    the entry's tie (lib/compact_log.lua; "0" for sorted sets)
ARGV[5+i]  window i's length in ms
ARGV[6+n]  optional: "C name", the entry's class in the reserved shares of its shared cap
           (lib/shares.lua): its class logs move with it (a replay marker "1" may follow)
--]]

-- The entry's cost set in its class's logs beside the shared cap windows among 1..n (keys
-- ending in ":shared", or ":shared:c" in the compact storage; lib/shares.lua's
-- "{window key}:class={name}" and its ":w" hash of costs and their total). An entry no
-- longer there (it left the window) is left alone; the same cost twice changes nothing.
local function set_class_costs(n, name, member, cost)
  for i = 1, n do
    if KEYS[i]:match(':shared$') or KEYS[i]:match(':shared:c$') then
      local key = KEYS[i] .. ':class=' .. name
      local weights = key .. ':w'
      local old = tonumber(redis.call('HGET', weights, member))
      if old and old ~= cost then
        if cost == 0 then
          redis.call('ZREM', key, member)
          redis.call('HDEL', weights, member)
        else
          redis.call('HSET', weights, member, cost)
        end
        redis.call('HINCRBY', weights, 'total', cost - old)
      end
    end
  end
end

-- Sets the entry's cost in windows 1..n of `log` (lib/zset_log.lua or lib/compact_log.lua):
-- the number of windows where it was still present and had not left the window.
local function set_costs(n, log)
  local member, at, cost, tie = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
  local found = 0
  for i = 1, n do
    found = found + log.set_cost(i, member, at, tie, cost, tonumber(ARGV[5 + i]))
  end
  local class = ARGV[6 + n]
  if class and class:sub(1, 2) == 'C ' then set_class_costs(n, class:sub(3), member, cost) end
  return found
end
