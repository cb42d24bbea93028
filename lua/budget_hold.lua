-- include: lib/clock.lua
-- include: lib/budget.lua
--[[
budget_hold.lua - holds an amount in every budget of one admission, all or nothing
(lib/budget.lua). The build (setup.py) prepends the files named above and embeds the whole
in the C extension: the only copy.

KEYS[3i-2], KEYS[3i-1], KEYS[3i]  budget i's keys (i = 1..n) for its previous, current and
         next period, "{prefix}:{owner}:{period_start_ms}:budget={name}" (script.c)
ARGV[1]  the hold's id (a UUID4 made by the client)
ARGV[2]  the request time in unix ms, or "" to read the server's clock (TIME)
ARGV[3]  hold_ms: a key lives until its period's end plus this (the longest hold)
ARGV[4 + 7(i-1) ..]  budget i: limit, amount, previous period's start, current period's
         start, its end (the next one's start), the next period's end (unix ms), its soft
         limits packed (percents in groups of three digits: 50080095; 0 for none)
ARGV[last]  optional replay marker ("1", proto.c): the id makes a replay safe, a hold
         already made (in any of the three periods: the replay may cross a boundary)
         answers as allowed, from the period that holds it, and holds nothing more.

Returns {allowed, refusing budget (0-based, -1 on allow), kind (0 allow, 1 permanent,
2 until_reset, 3 in_flight), now_ms, {remaining per budget}, {period start per budget},
{period end per budget}}, followed by {threshold fired before per budget}, {threshold
fired now per budget}} (0: none) when the hold crossed a soft limit of some budget (or is
the replay of one that did), or {0, -1, 0, now_ms, {}, {}, {}} when now falls in none of the
three periods sent for some budget (the client recomputes them from now_ms and asks
again). A refusal writes nothing; over maxmemory nothing is written.
--]]

local n = (#KEYS) / 3
local now = script_now(ARGV[2], true)
return budget_hold(n, ARGV[1], now, tonumber(ARGV[3]), 4, #ARGV > 3 + 7 * n)
