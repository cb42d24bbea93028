-- include: lib/clock.lua
-- include: lib/zset_log.lua
--[[
reconcile.lua - sets the cost of one logged entry to what the request really cost
(reserve -> reconcile). The keys are the same as sliding_window.lua's; the build
prepends the files named above.

KEYS[i]    (i = 1..n) the sorted sets the entry was logged in
KEYS[n+i]  the weights of KEYS[i] (lib/zset_log.lua)
KEYS[2n+i] the running totals of KEYS[i]'s weighted entries (lib/zset_log.lua): those
           after the entry move with its cost (O(weighted entries logged after it))
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

local n = #KEYS / 3
local now = script_now(ARGV[4], true)
local log = zset_log(n, now)
local member, score, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])

local found = 0
for i = 1, n do
  found = found + log.set_cost(i, member, score, cost, tonumber(ARGV[4 + i]))
end
return found
