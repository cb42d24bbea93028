--[[
lib/clock.lua - the time a script decides at. Prepended by the build (setup.py) to the
scripts that name it in an "-- include:" line; it defines functions only.
--]]

-- The request time in unix ms: `given` (the caller's clock) when it is a number, else the
-- server's TIME. `writes`: the script writes after reading TIME, which Redis before 7.0
-- allows only once it was told to replicate effects.
local function script_now(given, writes)
  local now = tonumber(given)
  if now then return now end
  if writes and redis.replicate_commands then redis.replicate_commands() end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
