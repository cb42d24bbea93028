-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/upstream.lua
--[[
observe_upstream.lua - one provider response's word on an upstream, recorded where every
replica's admissions through the shared cap read it (lib/upstream.lua). The numbers were
read from the response's headers and bounded by genai_ratelimit/provider_limits.py.

KEYS[1]   the upstream's view, "{prefix}:{name}:upstream"
ARGV[1]   now in unix ms, or "" to read the server's clock (TIME)
ARGV[2..4]  the requests the provider has left, ms until its reset (> 0), its limit (> 0)
ARGV[5..7]  the same for tokens
ARGV[8]   ms the upstream is closed for (a 429 or 529 with retry-after)
ARGV[9]   the operator's bound in ms (max_close_seconds), > 0
Each number but the bound is -1 when the response did not say.

Returns the upstream's closed-until time (unix ms), 0 when it is open.
--]]

local now = script_now(ARGV[1], true)
local numbers = {}
for i = 1, 8 do numbers[i] = tonumber(ARGV[i + 1]) end
return upstream_record(KEYS[1], now, numbers)
