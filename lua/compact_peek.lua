-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/compact_log.lua
--[[
compact_peek.lua - what compact_window.lua would answer now, without writing anything
(peek.lua for the compact storage). Read-only: it runs on a replica's EVALSHA too.

KEYS, ARGV  exactly compact_window.lua's (ARGV[1] and the replay marker are ignored).

Returns peek.lua's 8 elements (lib/decide.lua's peek_windows).
--]]

local n = #KEYS
local now = script_now(ARGV[2], false)
return peek_windows(n, now, compact_log(n, now))
