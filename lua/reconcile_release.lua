-- include: lib/clock.lua
-- include: lib/{storage}_log.lua
-- include: lib/lease.lua
-- include: lib/set_cost.lua
-- include: lib/in_flight.lua
-- include: lib/queue.lua
--[[
reconcile_release.lua - reconcile and release in one script execution, embedded once per
storage ("zset", "compact"): the slot of lease ARGV[1] given back, then the entry's cost
set (lib/in_flight.lua).

KEYS       reconcile.lua's (per storage), then the in-flight cap's wait queue (lease.lua's
           KEYS[3..4]: the release wakes the tickets it makes room for, lib/queue.lua's
           queue_wake, one EXISTS while none wait), then the user's leases and their stats
           (lease.lua's KEYS[1..2])
ARGV       reconcile.lua's (lib/set_cost.lua); the member is the lease id

Returns {windows whose entry was found, 1 when the lease was still held}. No OOM probe:
the release comes first and only frees memory.
--]]

local n = (#KEYS - 4) / KEYS_PER_WINDOW
local log, now = open_log(n, ARGV[4], true, false)
local reply = reconcile_release(n, log, now)
queue_wake(KEYS[#KEYS - 3], KEYS[#KEYS - 2], now, reply[2])
return reply
