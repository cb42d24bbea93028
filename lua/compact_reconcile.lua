-- include: lib/clock.lua
-- include: lib/compact_log.lua
-- include: lib/set_cost.lua
--[[
compact_reconcile.lua - reconcile.lua for the compact storage: sets the cost of one logged
entry, named by its time and tie (compact_window.lua's 8th element), to what the request
really cost.

KEYS[i]    (i = 1..n) the strings the entry was logged in
ARGV       lib/set_cost.lua's: the entry's member (unused), time (unix ms), new cost (0
           removes the entry), now ("": the server's clock), tie, each window's length

In every window where the entry is still present and has not yet left the window, its
cost becomes ARGV[3]; the running totals of the entries after it are rewritten (O(those
entries)). Setting the same cost twice changes nothing, so a replay is safe.

Returns the number of windows whose entry was found (0 when it has left them all).
--]]

-- The OOM probe of compact_window.lua.
redis.call('SETRANGE', KEYS[1], 0, '')

local n = #KEYS
return set_costs(n, compact_log(n, script_now(ARGV[4], true)))
