-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/zset_log.lua
--[[
sliding_window.lua - the sliding-window-log rate limiter, with weights, on sorted sets.
The build (setup.py) prepends the files named above (the clock, the decision over the
windows, the sorted-set log) and embeds the whole in the C extension: the only copy.

KEYS[i]    (i = 1..n) one sorted set per window, shortest window first
           (score = request time in unix ms, member = UUID4 text)
KEYS[n+i]  the weights of KEYS[i] (lib/zset_log.lua)
KEYS[2n+i] the running totals of KEYS[i]'s weighted entries (lib/zset_log.lua)
ARGV[1]    the member to add when every window allows
ARGV[2]    the request time in unix ms, or "" to read the server's clock (TIME)
ARGV[3i], ARGV[3i+1], ARGV[3i+2]
           window length in ms, limit and cost of KEYS[i] (limit and cost in cost units)
ARGV[3n+3] optional: "1" marks a replay of a call whose reply was lost. If the member is
           already logged in KEYS[n] (the longest window, where it stays longest), the
           first attempt was allowed and logged: answer allow again, write nothing, and
           report that entry's time (its score) as now_ms.

Returns lib/decide.lua's reply {allowed, remaining, retry_after_s, i, now_ms,
{remaining per window}, retry_ms}. A rejection writes nothing, and no key after the
rejecting window is touched.

A Redis over its maxmemory refuses the script with an OOM error before it writes
anything (see the probe below), rather than admitting requests it cannot log.
--]]

-- Redis refuses a command that may grow memory (ZADD) under OOM only while the
-- script has written nothing yet: a trim that removed an entry would let every
-- later ZADD through. So one such command goes first, one that changes nothing
-- (XX: only existing members; "" is never a member): over maxmemory it fails
-- the whole script with -OOM, and nothing was written.
redis.call('ZADD', KEYS[1], 'XX', 0, '')

local n = #KEYS / 3
local now = script_now(ARGV[2], true)
return (decide_and_log(n, now, zset_log(n, now), ARGV[3 * n + 3]))
