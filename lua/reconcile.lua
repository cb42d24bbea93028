-- include: lib/clock.lua
-- include: lib/zset_log.lua
-- include: lib/set_cost.lua
--[[
reconcile.lua - sets the cost of one logged entry to what the request really cost
(reserve -> reconcile). The keys are the same as sliding_window.lua's; the build
prepends the files named above.

KEYS[i]    (i = 1..n) the sorted sets the entry was logged in
KEYS[n+i]  the weights of KEYS[i] (lib/zset_log.lua)
KEYS[2n+i] the running totals of KEYS[i]'s weighted entries (lib/zset_log.lua): those
           after the entry move with its cost (O(weighted entries logged after it))
ARGV       lib/set_cost.lua's: the entry's member, score (the reservation's time, unix
           ms), new cost (0 removes the entry), now ("": the server's clock), tie
           (ignored here), then each window's length in ms

In every window where the entry is still present with that score and has not yet left
the window, its cost becomes ARGV[3]: a lower cost refunds, a higher one charges (used
may go above the limit: later requests wait longer; nothing is undone), 0 removes it.
Setting the same cost twice changes nothing, so a replay after a lost reply is safe.

Returns the number of windows whose entry was found (0 when it has left them all).
--]]

-- The OOM probe of sliding_window.lua: over maxmemory the script fails before any write.
redis.call('ZADD', KEYS[1], 'XX', 0, '')

local n = #KEYS / 3
return set_costs(n, zset_log(n, script_now(ARGV[4], true)))
