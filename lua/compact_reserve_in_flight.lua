-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/compact_log.lua
-- include: lib/lease.lua
-- include: lib/set_cost.lua
-- include: lib/in_flight.lua
--[[
compact_reserve_in_flight.lua - reserve_in_flight.lua for the compact storage: the user's
in-flight slot and compact_window.lua's decision in one script execution, all or nothing
(lib/in_flight.lua).

KEYS       compact_window.lua's KEYS[1..n], then the user's leases and their
           stats (lease.lua's KEYS[1..2])
ARGV       reserve_in_flight.lua's
Returns    reserve_in_flight.lua's 9 elements (the 8th, the entry's tie, names it here)
--]]

-- The OOM probe of the decision's script: over maxmemory nothing is written.
redis.call('SETRANGE', KEYS[1], 0, '')

local n = #KEYS - 2
local now = script_now(ARGV[2], true)
local log = compact_log(n, now)
local reply, tie, slot = reserve_in_flight(n, now, log)
if log.at then reply[5] = log.at end -- the entry's time (compact_window.lua)
reply[8] = tie
reply[9] = slot
return reply
