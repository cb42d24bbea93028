-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/upstream.lua
-- include: lib/{storage}_log.lua
-- include: lib/lease.lua
-- include: lib/set_cost.lua
-- include: lib/in_flight.lua
--[[
reserve_in_flight.lua - reserve with an in-flight slot, in one script execution, embedded
once per storage ("zset", "compact"): the user's slot (lease.lua's acquire, the lease id
being the entry's member) and sliding_window.lua's decision, all or nothing
(lib/in_flight.lua).

KEYS       sliding_window.lua's (per storage: KEYS[1..3n] or KEYS[1..n], then one upstream
           view per shared scope), then the user's leases and their stats (lease.lua's
           KEYS[1..2])
ARGV[1..3n+2]  the decision's (the member is also the lease id)
ARGV[3n+3] the most concurrent holders; ARGV[3n+4] the lease's length in ms
ARGV[3n+5] optional: "1" marks a replay after a lost reply

Returns the decision's 7 elements, the entry's tie (0 in the sorted-set storage; in the
compact one it names the entry, and now_ms is the entry's time) and {slot granted 1/0,
holders, the hint in ms when refused (lease.lua's), the lease's expiry, ms until the
soonest lease expires when refused}. A refused slot decides no window: element 4 (the
window) is 0; elements 3 and 7 are the hint.
--]]

local argc = #ARGV - 4 -- member, now, 3 per window, limit, lease (and the replay marker)
local n = (argc - argc % 3) / 3
-- The storage's OOM probe, as sliding_window.lua's: over maxmemory nothing is written.
local log, now = open_log(n, ARGV[2], true, true)
local upstreams = open_upstreams(n, KEYS_PER_WINDOW * n + 1, #KEYS - 2 - KEYS_PER_WINDOW * n, now)
local reply, tie, slot = reserve_in_flight(n, now, log, upstreams)
reply[8] = tie
reply[9] = slot
return reply
