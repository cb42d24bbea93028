-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/upstream.lua
-- include: lib/queue.lua
-- include: lib/{storage}_log.lua
-- include: lib/shares.lua
--[[
sliding_window.lua - the sliding-window-log rate limiter, with weights. The build
(setup.py) prepends the files named above (the clock, the decision over the windows, the
storage's log) and embeds the whole in the C extension, once per storage: "zset" (sorted
sets, lib/zset_log.lua) and "compact" (one string per window, lib/compact_log.lua, whose
header gives the value's layout: the same decisions, to the millisecond, in about 6 bytes
per logged request, 12 with weights, instead of 50 to 150).

KEYS, zset     KEYS[i] (i = 1..n) one sorted set per window, shortest window first
               (score = request time in unix ms, member = UUID4 text); KEYS[n+i] the
               weights of KEYS[i], KEYS[2n+i] the running totals of its weighted entries
KEYS, compact  KEYS[i] (i = 1..n) one string per window, shortest window first
KEYS[KEYS_PER_WINDOW * n + k]  the upstream view of the call's k-th shared scope
           (lib/upstream.lua), one per shared scope, after the windows' keys
KEYS[KEYS_PER_WINDOW * n + s + 2k - 1], KEYS[... + 2k]  the wait queue of the call's k-th
           shared scope (lib/queue.lua: its sorted set and its hash), after the s upstream
           views: a request the windows allow is refused while tickets it may not pass wait
ARGV[1]    the member to add when every window allows (compact: the request id, a UUID4,
           whose first 8 bytes go to the replay table of KEYS[n])
ARGV[2]    the request time in unix ms, or "" to read the server's clock (TIME)
ARGV[3i], ARGV[3i+1], ARGV[3i+2]
           window length in ms, limit and cost of KEYS[i] (limit and cost in cost units)
ARGV[3n+3] optional: a shared scope's reserved shares, "S ..." (lib/shares.lua); the reply
           then has one element more, last: 0, or the rule that refused (2j: the reserve of
           class j, 2j + 1: class j's ceiling)
ARGV[3n+3], after the shares when given, optional: the probes of the shared scopes that
           follow their provider, "P p_1 t_1 ..." (lib/upstream.lua's cold start)
ARGV[3n+3] (or later, after the shares and the probes) optional: "1" marks a replay of a call whose reply was lost. If the member is
           already logged in KEYS[n] (the longest window, where it stays longest; compact:
           in its replay table of the 8 latest admissions still in the window), the first
           attempt was allowed and logged: answer allow again, write nothing, and report that
           entry's time as now_ms.

Returns lib/decide.lua's reply {allowed, remaining, retry_after_s, i, now_ms,
{remaining per window}, retry_ms}; compact adds an 8th element, the tie of the entry
logged (0 when nothing was), which with its time names it for reconcile.lua, and now_ms
is that entry's time: the request's, or a later millisecond when the request's had no tie
left (lib/compact_log.lua). A rejection writes nothing (compact: but the trims of the
windows it reached), and no key after the rejecting window is touched.

A Redis over its maxmemory refuses the script with an OOM error before it writes
anything (the storage's OOM probe, open_log's), rather than admitting requests it cannot log.
--]]

-- The probe spec, when given, is last or just before the replay marker; nothing else a call
-- sends starts with "P" (byte 80): two byte reads, no new string, on every call.
local probe_at = #ARGV
if ARGV[probe_at]:byte(1) ~= 80 then
  probe_at = probe_at - 1
  if ARGV[probe_at]:byte(1) ~= 80 then probe_at = nil end
end
local argc = #ARGV - 2 - (probe_at and 1 or 0) -- member, now, 3 per window (shares, replay)
local n = (argc - argc % 3) / 3
-- The OOM probe when needed (the storage's); compact may decide an allowed plain check at once.
local log, now, decided = open_log(n, ARGV[2], true, 'lazy')
if decided then return decided end
local shared = (#KEYS - KEYS_PER_WINDOW * n) / 3 -- an upstream view and a queue's 2 keys each
local upstreams = shared > 0 and open_upstreams(n, KEYS_PER_WINDOW * n + 1, shared, now,
  probe_at and ARGV[probe_at]) or nil
local queues = shared > 0 and open_queues(KEYS_PER_WINDOW * n + shared + 1, shared, now) or nil
local marker, spec = ARGV[3 * n + 3], nil
if marker and marker:sub(1, 2) == 'S ' then spec, marker = marker, ARGV[3 * n + 4] end
if probe_at and marker == ARGV[probe_at] then marker = ARGV[probe_at + 1] end
local shares = open_shares(n, spec, now, log)
local reply, tie = decide_and_log(n, now, log, marker, upstreams, shares, queues)
if TIE_NAMES_ENTRY then reply[8] = tie end
if shares then reply[#reply + 1] = shares.refused end
return reply
