-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/{storage}_log.lua
--[[
peek.lua - what sliding_window.lua would answer now, without writing anything: no trim,
no entry, no TTL. Read-only (only reads and TIME), so it runs on a replica's EVALSHA too.
The build prepends the files named above, the ones sliding_window.lua decides with, and
embeds it once per storage ("zset", "compact"), as sliding_window.lua.

KEYS, ARGV  exactly sliding_window.lua's, per storage (ARGV[1], the member, is ignored, and
            so is the replay marker: a peek is answered the same however often it is sent).

The trim of sliding_window.lua is not done but accounted for (the storage's look,
lib/decide.lua's peek_windows): an entry at or before now - window_ms counts as gone, and
so does its weight. A sorted-set window written by a version that kept no running totals
is walked entry by entry (a read-only script builds nothing). So the answer equals the one
a check with the same windows and costs would give at the same instant.

Returns sliding_window.lua's 7 elements, computed the same way (an allow reports every
window's remaining after a request of the given cost; a reject stops at the rejecting
window), and an 8th: {used_1, oldest_1, ..., used_n, oldest_n} for every window, where
used is the cost logged in the window and oldest the time (unix ms) of its oldest entry
still in it, or -1 when it is empty.
--]]

local n = #KEYS / KEYS_PER_WINDOW
local log, now = open_log(n, ARGV[2], false, false)
return peek_windows(n, now, log)
