-- include: lib/clock.lua
-- include: lib/{storage}_log.lua
-- include: lib/set_cost.lua
--[[
reconcile.lua - sets the cost of one logged entry to what the request really cost
(reserve -> reconcile). The keys are sliding_window.lua's, per storage; the build
prepends the files named above and embeds it once per storage ("zset", "compact").

KEYS, zset     KEYS[i] (i = 1..n) the sorted sets the entry was logged in, KEYS[n+i] their
               weights and KEYS[2n+i] their running totals (lib/zset_log.lua): those after
               the entry move with its cost (O(weighted entries logged after it))
KEYS, compact  KEYS[i] (i = 1..n) the strings the entry was logged in; the running totals
               of the entries after it are rewritten (O(those entries))
ARGV       lib/set_cost.lua's: the entry's member (compact: unused), score (the
           reservation's time, unix ms), new cost (0 removes the entry), now ("": the
           server's clock), tie (zset: ignored; compact: sliding_window.lua's 8th element,
           which with the time names the entry), then each window's length in ms

In every window where the entry is still present with that time and has not yet left the
window, its cost becomes ARGV[3]: a lower cost refunds, a higher one charges (used may go
above the limit: later requests wait longer; nothing is undone), 0 removes it. Setting
the same cost twice changes nothing, so a replay after a lost reply is safe.

Returns the number of windows whose entry was found (0 when it has left them all).
--]]

-- With the storage's OOM probe, as sliding_window.lua: over maxmemory nothing is written.
local n = #KEYS / KEYS_PER_WINDOW
return set_costs(n, (open_log(n, ARGV[4], true, true)))
