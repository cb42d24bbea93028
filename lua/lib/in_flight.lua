--[[
lib/in_flight.lua - a GenAI request's way in and out in one script execution each: its
in-flight slot (lib/lease.lua) together with its reservation (lib/decide.lua), and its
reconcile (lib/set_cost.lua) together with the slot's release. Prepended by the build
(setup.py) to reserve_in_flight.lua and reconcile_release.lua, over either storage;
functions only. The user's leases key and its stats key (lib/lease.lua) are the last two
KEYS.
--]]

-- Takes the slot and decides the windows, all or nothing: a refused slot decides no window
-- (nothing is logged), a refused window takes no slot. ARGV[3n+3] is the slot limit,
-- ARGV[3n+4] the lease's length in ms, ARGV[3n+5] the optional replay marker; the lease id
-- is the entry's member (ARGV[1]). Returns the decision's reply, the entry's tie and
-- {slot granted 1/0, holders, the hint for a slot in ms (refused) or 0, the lease's expiry
-- or 0, the wait until the soonest lease expires (refused) or 0}. A refused slot answers
-- {0, 0, retry_s, 0, now, {}, retry_ms} with the hint: window 0, none decided.
local function reserve_in_flight(n, now, log, upstreams)
  local held = leases(KEYS[#KEYS - 1], KEYS[#KEYS], now)
  -- The lease id is the call's fresh member: held already only on a replay (marked).
  local slot = held.may_acquire(ARGV[1], tonumber(ARGV[3 * n + 3]), ARGV[3 * n + 5] ~= '1')
  if slot[1] == 0 then
    return {0, 0, math.ceil(slot[3] / 1000), 0, now, {}, slot[3]}, 0,
           {0, slot[2], slot[3], 0, slot[5]}
  end
  local reply, tie = decide_and_log(n, now, log, ARGV[3 * n + 5], upstreams)
  if reply[1] == 0 then return reply, tie, {0, slot[2] - 1, 0, 0, 0} end
  return reply, tie, {1, slot[2], 0, held.take(ARGV[1], tonumber(ARGV[3 * n + 4]), slot), 0}
end

-- Gives the slot of lease ARGV[1] back, then sets the entry's cost (lib/set_cost.lua).
-- The release goes first: it only frees memory, so a Redis over its maxmemory never refuses
-- it. Returns {windows found, 1 when the lease was still held}.
local function reconcile_release(n, log, now)
  local released = leases(KEYS[#KEYS - 1], KEYS[#KEYS], now).release(ARGV[1])
  return {set_costs(n, log), released}
end
