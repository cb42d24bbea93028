-- include: lib/clock.lua
--[[
observe_upstream.lua - one provider response's word on an upstream, recorded where every
replica's admissions through the shared cap read it (lib/upstream.lua). The numbers were
read from the response's headers and bounded by genai_ratelimit/provider_limits.py; the
hash's fields are described in lib/upstream.lua, which reads them.

KEYS[1]   the upstream's view, "{prefix}:{name}:upstream"
ARGV[1]   now in unix ms, or "" to read the server's clock (TIME)
ARGV[2..4]  the requests the provider has left, ms until its reset (> 0), its limit (> 0)
ARGV[5..7]  the same for tokens
ARGV[8]   ms the upstream is closed for (a 429 or 529 with retry-after)
ARGV[9]   the operator's bound in ms (max_close_seconds), > 0
Each number but the bound is -1 when the response did not say; all of them -1 (an answer
that said nothing) writes only `bound` into an existing view (a cold cap's probes: the
provider was heard from) and nothing when there is none.

Returns the upstream's closed-until time (unix ms), 0 when it is open.
--]]

-- Records one response's view, the numbers -1 when the response did
-- not say: per resource the remaining, the ms until its reset and the limit; the ms the
-- upstream is closed for; the bound (ms). The provider's latest word on a resource replaces
-- the view's, less the requests admitted since that it cannot have counted (this answer's
-- own request is no longer one of them); a closure only ever lengthens. Returns
-- closed_until (unix ms), 0 when open.
local function upstream_record(key, now, numbers)
  local view = redis.call('HMGET', key, 'requests_reset', 'tokens_reset', 'closed_until',
                          'requests_sent', 'requests_sent_at')
  local bound = numbers[8]
  local last = 0
  local function keep(at) if at and at > now and at > last then last = at end end
  -- The requests on their way, this answer's own no longer among them; those counted from
  -- longer than the bound ago are answered, or never will be.
  local sent, sent_at = 0, tonumber(view[5])
  if sent_at and now - sent_at < bound then sent = math.max(0, (tonumber(view[4]) or 0) - 1) end
  if view[4] then redis.call('HSET', key, 'requests_sent', sent) end
  local function record(field, left, reset_in, limit, old_reset, unsent)
    if limit > 0 then redis.call('HSET', key, field .. '_limit', limit) end
    if left >= 0 and reset_in > 0 then
      redis.call('HSET', key, field, math.max(0, left - unsent), field .. '_reset', now + reset_in)
      keep(now + reset_in)
    else
      keep(tonumber(old_reset))
    end
  end
  record('requests', numbers[1], numbers[2], numbers[3], view[1], sent)
  record('tokens', numbers[4], numbers[5], numbers[6], view[2], 0)
  local closed = tonumber(view[3]) or 0
  if numbers[7] > 0 and now + numbers[7] > closed then
    closed = now + numbers[7]
    redis.call('HSET', key, 'closed_until', closed)
  end
  if closed <= now then closed = 0 end
  keep(closed)
  redis.call('HSET', key, 'bound', bound)
  redis.call('PEXPIRE', key, math.max(last, now) - now + bound)
  return closed
end

local now = script_now(ARGV[1], true)
local numbers = {}
for i = 1, 8 do numbers[i] = tonumber(ARGV[i + 1]) end
-- An answer that says nothing (a success without rate-limit headers) only ends a cold
-- start: with no view (no probe out), nothing is written.
local silent = true
for i = 1, 7 do if numbers[i] >= 0 then silent = false end end
if silent and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return upstream_record(KEYS[1], now, numbers)
