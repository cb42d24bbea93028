-- include: lib/clock.lua
-- include: lib/gcra.lua
-- include: lib/decide.lua
-- include: lib/{storage}_log.lua
--[[
gcra_windows.lua - one decision over a GCRA bucket (lib/gcra.lua) and a call's windows
(lib/decide.lua over the storage's log), all or nothing: check_windows_detailed(...,
gcra=(rate, period_seconds, burst)), e.g. a FastAPI tier's minute budget as GCRA beside its
day window. The build (setup.py) prepends the files named above and embeds the whole in
the C extension, once per storage, like sliding_window.lua: no arithmetic of its own.

KEYS     the windows' keys as sliding_window.lua takes them (n windows), then the GCRA
         key "{prefix}:{user_id}:{period_seconds}:gcra" (lua/gcra.lua's), last
ARGV[1], ARGV[2], ARGV[3i..3i+2]  as sliding_window.lua (member, now, each window)
ARGV[3n+3 .. 3n+6]  the GCRA's interval, scale, burst and cost (lua/gcra.lua's ARGV[2..5])
ARGV[3n+7]  optional replay marker ("1"): if the member is logged in KEYS[n], the first
            attempt was allowed and charged both the windows and the bucket (one script):
            allowed again, nothing charged. Without windows (n = 0) a replay is decided anew,
            as lua/gcra.lua does.

Returns lib/decide.lua's reply over n + 1 windows, the bucket being window 1 and the log's
window i being window i + 1: {allowed, remaining, retry_after_s, i, now_ms, {remaining per
window}, retry_ms}, and compact's tie 8th. The bucket is decided first: its refusal is
{0, 0, retry_after_s, 1, now, {0}, retry_ms} with its theoretical arrival time's wait. A
refusal writes nothing (compact: but the trims of the windows it reached).
--]]

local n = (#KEYS - 1) / KEYS_PER_WINDOW
local g = 3 * n + 3
local gkey, interval, scale, burst, cost = KEYS[#KEYS], tonumber(ARGV[g]), tonumber(ARGV[g + 1]),
  tonumber(ARGV[g + 2]), tonumber(ARGV[g + 3])

-- reply (lib/decide.lua's, over the log's n windows) with the bucket as window 1, whose
-- remaining is `left`.
local function with_bucket(reply, left)
  local remaining_of = {left}
  for i = 1, #reply[6] do remaining_of[i + 1] = reply[6][i] end
  if reply[1] == 1 then
    reply = allowed_reply(n + 1, reply[5], remaining_of)
  else
    reply[4], reply[6] = reply[4] + 1, remaining_of
  end
  return reply
end

local function tied(reply, tie)
  if TIE_NAMES_ENTRY then reply[8] = tie end
  return reply
end

if n == 0 then
  local bucket = gcra_decide(gkey, script_now(ARGV[2], true), interval, scale, burst, cost, true)
  return tied({bucket[1], bucket[2], bucket[3], 1, bucket[5], {bucket[2]}, bucket[4]}, 0)
end
local log, now = open_log(n, ARGV[2], true, true) -- the OOM probe first, then the clock
if ARGV[g + 4] == '1' and log.logged(n, ARGV[1]) then
  -- What the bucket has left now, at most burst - 1: this request's own unit counts there
  -- until it drains, as it does in the windows (which hold its entry).
  local left = gcra_decide(gkey, now, interval, scale, burst, 0, false)[2]
  local reply, tie = decide_and_log(n, now, log, '1')
  return tied(with_bucket(reply, math.min(left, burst - 1)), tie)
end
local bucket = gcra_decide(gkey, now, interval, scale, burst, cost, false) -- read only
if bucket[1] == 0 then
  log.flush()
  return tied({0, 0, bucket[3], 1, now, {0}, bucket[4]}, 0)
end
local reply, tie = decide_and_log(n, now, log, nil)
if reply[1] == 1 then -- the windows logged the request: the bucket is charged too
  gcra_store(gkey, now, bucket[6], scale)
  return tied(with_bucket(reply, bucket[2]), tie)
end
return tied(with_bucket(reply, bucket[2] + cost), tie)
