--[[
lib/set_cost.lua - reconcile's work, the same for every storage: the cost of one logged
entry set to what the request really cost, in every window of the call. Prepended by the
build (setup.py) to the reconciling scripts; functions only.

ARGV[1]    the entry's member
ARGV[2]    the entry's time (the reservation's, unix ms)
ARGV[3]    the entry's new cost, an integer >= 0 (0 removes the entry)
ARGV[4]    now in unix ms, or "" to read the server's clock (TIME)
ARGV[5]    the entry's tie (lib/compact_log.lua; "0" for sorted sets)
ARGV[5+i]  window i's length in ms
--]]

-- Sets the entry's cost in windows 1..n of `log` (lib/zset_log.lua or lib/compact_log.lua):
-- the number of windows where it was still present and had not left the window.
local function set_costs(n, log)
  local member, at, cost, tie = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
  local found = 0
  for i = 1, n do
    found = found + log.set_cost(i, member, at, tie, cost, tonumber(ARGV[5 + i]))
  end
  return found
end
