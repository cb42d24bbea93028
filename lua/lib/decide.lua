--[[
lib/decide.lua - the decision over a call's windows, the same for every storage: which
window refuses, what each window has left, how long a refused request waits. Prepended by
the build (setup.py) to the scripts that decide; it defines functions only and touches no
key: a storage (lib/zset_log.lua, lib/compact_log.lua) measures the windows.

ARGV[3i], ARGV[3i+1], ARGV[3i+2]  window i's length in ms, limit and this request's cost
                                  (limit and cost in cost units), i = 1..n.

The reply of a decision, {allowed, remaining, retry_after_s, i, now_ms,
{remaining per window}, retry_ms}:
  allow  -> {1, fewest remaining over all windows after this request, 0, index of that
             window (ties: the shorter), now, {limit - used - cost ...}, 0}
  reject -> {0, 0, max(1, ceil(wait / 1000)), index of the rejecting window, now,
             {limit - used of the windows before it ..., 0}, max(1, wait)},
where wait = stamp + window_ms - now and stamp is the time of the oldest entry whose
leaving frees enough: the costs of the entries up to it add up to used + cost - limit.
--]]

-- Window i of the call: its length in ms, its limit, this request's cost in it.
local function window_of(i)
  return tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1]), tonumber(ARGV[3 * i + 2])
end

-- The wait until the entry logged at `stamp` leaves a window of window_ms: seconds rounded
-- up and ms, each at least 1. stamp nil (no entry frees enough: only a cost above the
-- limit, which the client refuses) waits the whole window.
local function wait_until_gone(stamp, window_ms, now)
  local wait = stamp and stamp + window_ms - now or window_ms
  if wait < 1 then wait = 1 end
  return math.ceil(wait / 1000), wait
end

-- The allowed reply over windows 1..n whose remaining units are remaining_of[i]: the
-- fewest remaining, and that window's index (ties: the shorter, the first).
local function allowed_reply(n, now, remaining_of)
  local fewest_index = 1
  for i = 2, n do
    if remaining_of[i] < remaining_of[fewest_index] then fewest_index = i end
  end
  return {1, remaining_of[fewest_index], 0, fewest_index, now, remaining_of, 0}
end

-- Decides windows 1..n in order: used_of(i, window_ms) is window i's used cost at now
-- (called once per window, in order, never for a window after the refusing one), and
-- freeing_stamp(i, window_ms, need) the time of the oldest entry of window i whose leaving
-- frees `need` units (nil: none does). Returns the reply (see the header); nothing is
-- charged on a refusal, so the windows before it report what they had.
local function decide(n, now, used_of, freeing_stamp)
  local remaining_of = {}
  for i = 1, n do
    local window_ms, limit, cost = window_of(i)
    local used = used_of(i, window_ms)
    if used + cost > limit then
      for j = 1, i - 1 do remaining_of[j] = remaining_of[j] + tonumber(ARGV[3 * j + 2]) end
      remaining_of[i] = 0
      local need = used + cost - limit
      local retry, wait = wait_until_gone(freeing_stamp(i, window_ms, need), window_ms, now)
      return {0, 0, retry, i, now, remaining_of, wait}
    end
    remaining_of[i] = limit - used - cost
  end
  return allowed_reply(n, now, remaining_of)
end

-- The reply to a replay whose first attempt was allowed and logged: allowed again, with
-- what every window has left now (never below 0), nothing charged a second time.
local function decided_before(n, now, used_of)
  local remaining_of = {}
  for i = 1, n do
    local window_ms, limit = window_of(i)
    remaining_of[i] = math.max(0, limit - used_of(i, window_ms))
  end
  return allowed_reply(n, now, remaining_of)
end

-- A decision that logs (sliding_window.lua, reserve_in_flight.lua), over `log`, a storage of
-- lib/zset_log.lua or lib/compact_log.lua. ARGV[1] is the member to log, `marker` the
-- call's replay marker: a replay whose first attempt was allowed and logged in KEYS[n]
-- (the longest window, where it stays longest) is allowed again, logging nothing, and
-- reports that entry's time. On allow every window logs the entry with its cost, and the
-- reply's now_ms is the entry's time, the one log.tie() gives with the tie when the storage
-- may log it at a later millisecond than now (lib/compact_log.lua). Returns the reply and
-- the entry's tie (lib/compact_log.lua; 0 for sorted sets). `upstreams`: the views of the
-- call's shared scopes (lib/upstream.lua's open_upstreams), or nil: a request the windows
-- allow is refused when a view says so, and charged to the views when it is logged.
-- `shares`: the reserved shares of a shared scope (lib/shares.lua's open_shares), or nil:
-- decided before the views, on the windows' own counts, and charged the same way.
-- `queues`: the wait queues of the call's shared scopes (lib/queue.lua's open_queues), or
-- nil: a request allowed so far is refused while tickets it may not pass wait.
local function decide_and_log(n, now, log, marker, upstreams, shares, queues)
  if marker == '1' then
    local at, tie = log.logged(n, ARGV[1])
    if at then
      local reply = decided_before(n, at, log.trim)
      log.flush()
      return reply, tie
    end
  end
  local reply = decide(n, now, log.trim, log.freeing_stamp)
  if shares and reply[1] == 1 then reply = shares.check(reply) end
  if upstreams and reply[1] == 1 then reply = upstreams.check(reply) end
  if queues and reply[1] == 1 then reply = queues.check(reply, log, n) end
  local tie, at = 0, nil
  if reply[1] == 1 then
    tie, at = log.tie()
    for i = 1, n do
      local window_ms, _, cost = window_of(i)
      log.add(i, ARGV[1], cost, window_ms, tie)
    end
    if at then reply[5] = at end
    if shares then shares.charge(reply[5]) end
    if upstreams then upstreams.charge() end
  end
  log.flush()
  return reply, tie
end

-- What decide_and_log would answer now, without writing (peek.lua, either storage): the
-- windows' trims accounted for, not done. The reply has an 8th element, {used_1, oldest_1,
-- ..., used_n, oldest_n}: every window's used cost and its oldest entry's time (unix ms),
-- or -1 when it is empty.
local function peek_windows(n, now, log)
  local usage, used_of = {}, {}
  for i = 1, n do
    local used, oldest = log.look(i, tonumber(ARGV[3 * i]))
    used_of[i] = used
    usage[2 * i - 1] = used
    usage[2 * i] = oldest or -1
  end
  local reply = decide(n, now, function(i) return used_of[i] end, log.peek_freeing_stamp)
  reply[8] = usage
  return reply
end
