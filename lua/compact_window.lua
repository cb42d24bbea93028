-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/compact_log.lua
--[[
compact_window.lua - the sliding-window-log rate limiter, with weights, on one Redis string
per window (storage "compact"): sliding_window.lua's decisions, to the millisecond, in
about 6 bytes per logged request (12 with weights) instead of 50 to 150. The build
(setup.py) prepends the files named above (the clock, the decision over the windows, the
compact log, whose header gives the value's layout) and embeds the whole in the C
extension: the only copy.

KEYS[i]    (i = 1..n) one string per window, shortest window first
ARGV       sliding_window.lua's: ARGV[1] the request id (a UUID4: the first 8 bytes of it
           go to the replay table of KEYS[n]), ARGV[2] the request time in unix ms or ""
           (the server's clock), ARGV[3i..3i+2] window i's length in ms, limit and cost,
           ARGV[3n+3] the optional replay marker "1": a request id still in KEYS[n]'s
           replay table (its 8 latest admissions) was allowed and logged by its first
           attempt: allowed again, nothing written, that entry's time reported as now_ms.

Returns sliding_window.lua's 7 elements and an 8th: the tie of the entry logged (0 when
nothing was), which with its time names it for compact_reconcile.lua. now_ms (the 5th) is
that entry's time: the request's, or a later millisecond when the request's had no tie
left (lib/compact_log.lua). A rejection writes nothing but the trims of the windows it
reached, and no key after the rejecting window is touched.
--]]

-- The OOM probe: SETRANGE may grow memory, so a Redis over its maxmemory refuses it while
-- the script has written nothing; with an empty value it changes nothing (and creates no
-- key). Later writes are then let through, as the script can no longer stop halfway.
redis.call('SETRANGE', KEYS[1], 0, '')

local n = #KEYS
local now = script_now(ARGV[2], true)
local log = compact_log(n, now)
local reply, tie = decide_and_log(n, now, log, ARGV[3 * n + 3])
-- The time of the entry logged (a later millisecond when now had no tie left): it names it.
if log.at then reply[5] = log.at end
reply[8] = tie
return reply
