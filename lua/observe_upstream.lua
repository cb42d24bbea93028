-- include: lib/clock.lua
-- include: lib/decide.lua
-- include: lib/upstream.lua
--[[
observe_upstream.lua - one provider response's word on an upstream, recorded where every
replica's admissions through the shared cap read it (lib/upstream.lua). The numbers were
read from the response's headers and bounded by genai_ratelimit/provider_limits.py.

KEYS[1]   the upstream's view, "{prefix}:{name}:upstream"
ARGV[1]   now in unix ms, or "" to read the server's clock (TIME)
ARGV[2]   the requests the provider has left, -1 when the response did not say
ARGV[3]   ms until those reset (> 0), -1 when unknown
ARGV[4]   the tokens the provider has left, -1 when unknown
ARGV[5]   ms until those reset (> 0), -1 when unknown
ARGV[6]   ms the upstream is closed for (a 429 or 529 with retry-after), -1 when it was not

Returns the upstream's closed-until time (unix ms), 0 when it is open.
--]]

local now = script_now(ARGV[1], true)
return upstream_record(KEYS[1], now, tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
                       tonumber(ARGV[5]), tonumber(ARGV[6]))
