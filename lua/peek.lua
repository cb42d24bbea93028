-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/queue.lua
-- include: lib/{storage}_log.lua
--[[
peek.lua - what sliding_window.lua would answer now, without writing anything: no trim,
no entry, no TTL. Read-only (only reads and TIME), so it runs on a replica's EVALSHA too.
The build prepends the files named above, the ones sliding_window.lua decides with, and
embeds it once per storage ("zset", "compact"), as sliding_window.lua.

KEYS       sliding_window.lua's windows, per storage; then, for the call's k-th shared
           scope, the two keys of its wait queue (lib/queue.lua: its sorted set and its
           hash), without the upstream views sliding_window.lua reads between them
ARGV       exactly sliding_window.lua's (ARGV[1], the member, is ignored, and so is the
           replay marker: a peek is answered the same however often it is sent).

The trim of sliding_window.lua is not done but accounted for (the storage's look,
lib/decide.lua's peek_windows): an entry at or before now - window_ms counts as gone, and
so does its weight. A sorted-set window written by a version that kept no running totals
is walked entry by entry (a read-only script builds nothing). So the answer equals the one
a check with the same windows and costs would give at the same instant. The tickets of a
shared scope's wait queue count as in lib/queue.lua's check, for a request without a
ticket (it goes after every live ticket), read without the purge: a ticket whose deadline
has passed among the first PURGE_SCAN is left out, as the purge would leave it.

Returns sliding_window.lua's 7 elements, computed the same way (an allow reports every
window's remaining after a request of the given cost; a reject stops at the rejecting
window), and an 8th: {used_1, oldest_1, ..., used_n, oldest_n} for every window, where
used is the cost logged in the window and oldest the time (unix ms) of its oldest entry
still in it, or -1 when it is empty.
--]]

local argc = #ARGV - 2 -- member, now, then 3 per window (and what sliding_window.lua takes after)
local n = (argc - argc % 3) / 3
local log, now = open_log(n, ARGV[2], false, false)
local reply = peek_windows(n, now, log)
local queued = (#KEYS - KEYS_PER_WINDOW * n) / 2
if queued == 0 or reply[1] ~= 1 then return reply end

-- lib/queue.lua's check, read-only, for a request without a ticket: its rank is the
-- number of live tickets; the windows of each scope must hold them and it too.
local wait, at, expiry = 0, nil, nil
for k = 0, queued - 1 do
  local zkey = KEYS[KEYS_PER_WINDOW * n + 1 + 2 * k]
  local head = redis.call('ZRANGE', zkey, 0, PURGE_SCAN - 1)
  if #head > 0 then
    local rank = redis.call('ZCARD', zkey)
    for _, member in ipairs(head) do
      local deadline = queue_parse(member)
      if deadline and deadline <= now then
        rank = rank - 1
      elseif deadline and (not expiry or deadline < expiry) then
        expiry = deadline
      end
    end
    wait, at = queue_room_wait(zkey, rank, reply, n, log.peek_freeing_stamp, now, wait, at)
  end
end
if not at then return reply end
if expiry and expiry - now < wait then wait = math.max(1, expiry - now) end
local refusal = queue_refusal(reply, at, wait, now)
refusal[8] = reply[8]
return refusal
