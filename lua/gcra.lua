-- include: lib/clock.lua
-- include: lib/gcra.lua
--[[
gcra.lua - one GCRA decision (lib/gcra.lua): `rate` requests per `period`, up to `burst` at
once, for a request of weight `cost`. The build (setup.py) prepends the files named above
and embeds the whole in the C extension: the only copy.

KEYS[1]  the user's GCRA key, "{prefix}:{user_id}:{period_seconds}:gcra" (script.c): a
         string holding the theoretical arrival time (lib/gcra.lua), with a TTL until the
         whole burst is available again, plus 1 s
ARGV[1]  the request time in unix ms, or "" to read the server's clock (TIME)
ARGV[2]  interval: the emission interval period / rate in units of 1/scale ms
ARGV[3]  scale: rate / gcd(rate, period_ms)
ARGV[4]  burst: the most requests (cost units) admitted at once
ARGV[5]  cost (1 <= cost <= burst)
ARGV[6]  optional replay marker ("1", proto.c): ignored. A decision whose reply was lost
         with its connection is decided anew: the request counts again if its first attempt
         was allowed (never more admitted than the algorithm allows; one cost less left).

Returns {allowed, remaining, retry_after_s, retry_ms, now_ms} (lib/gcra.lua's gcra_decide).
A refusal writes nothing. The only write is one SET, Redis's OOM check refuses it before
anything is written.
--]]

local now = script_now(ARGV[1], true)
return gcra_decide(KEYS[1], now, tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
                   tonumber(ARGV[5]), true)
