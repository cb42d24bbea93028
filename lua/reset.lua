-- include: lib/compact_log.lua
--[[
reset.lua - forgets a user's entries: in the windows named, or in every window of the
user, found by SCAN one bounded step at a time.

KEYS[i]    (i = 1..n) the windows to reset (n may be 0): sorted sets (lib/zset_log.lua)
           or strings named "...:c" (lib/compact_log.lua), then the sorted sets'
           companions (weights, running totals), deleted too
ARGV[1]    "" to reset KEYS; else a SCAN cursor ("0" to start): reset every key of the
           user that one SCAN step (ARGV[1] MATCH ARGV[2] COUNT ARGV[4]) finds
ARGV[2]    the MATCH pattern of the user's keys: ARGV[3], glob-escaped, then "*"
ARGV[3]    the start of every key of the user, "{prefix}:{user_id}:"
ARGV[4]    the SCAN step's COUNT
ARGV[5]    with ARGV[1] "": n, the number of KEYS that are windows (the others are companions)

A key found by SCAN is the user's only when what follows ARGV[3] is a window's own
suffix: "<digits>", "<digits>:tokens", either followed by ":scope=<name>" (a route's or a
model's budget of the user; the name holds no ':'), and any of those followed by ":w" (a
user id may hold ':', so "ratelimit:a:" also starts user "a:b"'s keys, whose suffix is
"b:60"). A window's companions end in ":w" (weights) or ":t" (running totals); a compact
window is its window's key and ":c". Both storages' keys are reset, and the user's GCRA
buckets ("<digits>:gcra", lua/gcra.lua's and lua/gcra_windows.lua's; no entries to count). A shared scope's keys (":shared", an upstream's caps) are no user's.

Returns {entries removed (the windows' entries), the cursor to go on from ("0": done)}. A
window's key it cannot read (a compact value of another layout version, e.g. a newer
release's, or damaged; a key of another type) is deleted all the same, and counts 0: reset
is the remedy for such a key, which every check refuses.
Not atomic across SCAN steps: an entry logged meanwhile in a key already visited stays.
--]]

local removed = 0

-- The entries a window holds, whichever storage keeps it (a compact window's key ends in
-- ":c", which no sorted-set window's does); 0 when they cannot be counted.
local function entries(key)
  if string.sub(key, -2) == ':c' then return compact_entries(key) or 0 end
  local ok, count = pcall(redis.call, 'ZCARD', key)
  return ok and count or 0
end

if ARGV[1] == '' then
  for i = 1, tonumber(ARGV[5]) do removed = removed + entries(KEYS[i]) end
  if #KEYS > 0 then redis.call('DEL', unpack(KEYS)) end
  return {removed, '0'}
end

-- Before 7.0, a script that wrote after SCAN (non-deterministic) must replicate effects.
if redis.replicate_commands then redis.replicate_commands() end
local step = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[4])
local base = #ARGV[3]
for _, key in ipairs(step[2]) do
  -- A user's scope is one of its windows with ":scope=<name>" after it (script.c).
  local suffix = string.gsub(string.sub(key, base + 1), ':scope=[^:]*', '', 1)
  if string.find(suffix, '^%d+$') or string.find(suffix, '^%d+:tokens$') or
      string.find(suffix, '^%d+:c$') or string.find(suffix, '^%d+:tokens:c$') then
    removed = removed + entries(key)
    redis.call('DEL', key)
  elseif string.find(suffix, '^%d+:[wt]$') or string.find(suffix, '^%d+:tokens:[wt]$') or
      string.find(suffix, '^%d+:gcra$') then
    redis.call('DEL', key)
  end
end
return {removed, step[1]}
