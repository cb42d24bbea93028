-- include: lib/clock.lua
-- include: lib/compact_log.lua
-- include: lib/lease.lua
-- include: lib/set_cost.lua
-- include: lib/in_flight.lua
--[[
compact_reconcile_release.lua - reconcile_release.lua for the compact storage: the slot of
lease ARGV[1] given back, then the entry's cost set (lib/in_flight.lua).

KEYS       compact_reconcile.lua's, then the user's leases and their
           stats (lease.lua's KEYS[1..2])
ARGV       compact_reconcile.lua's (lib/set_cost.lua); the member is the lease id
Returns    reconcile_release.lua's {windows found, 1 when the lease was still held}
--]]

local n = #KEYS - 2
local now = script_now(ARGV[4], true)
return reconcile_release(n, compact_log(n, now), now)
