--[[
lib/gcra.lua - the generic cell rate algorithm (GCRA): `rate` requests per `period`, up to
`burst` at once. Prepended by the build (setup.py) to the scripts that name it in an
"-- include:" line; it defines functions only.

The algorithm (virtual scheduling). T = period / rate is the emission interval: one
request's share of the period. A key's whole state is one time, the theoretical arrival
time TAT: when the whole burst would be available again, had every admitted request been
spaced T apart. A request of `cost` at `now` is allowed when

    max(TAT, now) + cost * T - now <= burst * T

(its last unit is no earlier than the tolerance tau = (burst - 1) * T allows), and then
TAT becomes max(TAT, now) + cost * T. A refusal changes nothing. An idle key (TAT <= now)
admits `burst` at once; after that one request per T.

Exact arithmetic. Lua's numbers are doubles: every value below stays an integer under
2^53, so every operation is exact. T is rarely a whole number of ms (60 s / 7 is
8571.43 ms), so times are counted in units of 1/scale ms, where
    scale = rate / gcd(rate, period_ms),  interval = period_ms / gcd(rate, period_ms)
and T = interval / scale ms exactly. The caller (script.c) sends interval and scale and
checks burst * interval + 2 * scale < 2^53. TAT is kept as whole ms plus a remainder in
units (0 <= remainder < scale); only the difference TAT - now is ever multiplied by scale,
and only when it is at most burst * T (+1 ms), so no product leaves the exact range.

The key's value: the TAT as one integer, "<TAT ms><6 digits>", the 6 digits being
scale * 1000 + remainder (0 when the TAT is a whole ms): Redis keeps an integer in the
key object itself, the smallest string there is. It takes scales up to 999 (every rate up
to 999 per period, and larger ones that share factors with the period's ms) and TATs
before the year 2262 (19 digits); beyond either, the string "<TAT ms>:<remainder>:<scale>".
A value written at another scale (the rate was changed) keeps its whole ms and rounds a
non-zero remainder up to the next ms: the budget's edit keeps the user's state, later by
under 1 ms at most, never earlier. The integer is read and written in two parts (its last
6 digits apart), so no number above 2^53 is ever made.
--]]

-- floor(a / b) and a - b * floor(a / b) for integers 0 <= a < 2^53, 1 <= b: the double
-- division may round to the next integer, so the quotient is corrected by its remainder.
local function gcra_divmod(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then
    q, r = q - 1, r + b
  elseif r >= b then
    q, r = q + 1, r - b
  end
  return q, r
end

-- The integer form's bounds (see above): the largest scale, and the first TAT in ms whose
-- integer would not fit Redis's 64-bit integers.
local GCRA_CODED_SCALE = 999
local GCRA_CODED_MS = 9000000000000

-- The TAT stored in `raw` (GET's answer) as (whole ms, remainder in 1/scale ms), or nil
-- for a key that does not exist (or holds nothing this library wrote).
local function gcra_read(raw, scale)
  if not raw then return nil, 0 end
  local ms, rem, from
  if not string.find(raw, ':', 1, true) then -- the integer form (GET answers its digits)
    local code = tonumber(string.sub(raw, -6))
    ms, from, rem = tonumber(string.sub(raw, 1, -7)), math.floor(code / 1000), code % 1000
  else
    ms, rem, from = string.match(raw, '^(%d+):(%d+):(%d+)$')
    if not ms then return nil, 0 end
    ms, rem, from = tonumber(ms), tonumber(rem), tonumber(from)
  end
  if not ms then return nil, 0 end
  if rem > 0 and from ~= scale then return ms + 1, 0 end
  return ms, rem
end

-- The value that stores the TAT `ms` + `rem` / scale.
local function gcra_value(ms, rem, scale)
  if rem == 0 then return string.format('%.0f000000', ms) end
  if scale <= GCRA_CODED_SCALE and ms < GCRA_CODED_MS then
    return string.format('%.0f%06d', ms, scale * 1000 + rem)
  end
  return string.format('%.0f:%.0f:%.0f', ms, rem, scale)
end

-- Stores the TAT now + `after` units (1/scale ms) in `key`: an allowed decision's write.
-- Kept until the whole burst is available again (the TAT), and a second more: an idle user
-- costs nothing. The only write, and the first: Redis over maxmemory refuses this SET (it
-- may grow memory) before anything was written.
local function gcra_store(key, now, after, scale)
  local ms, r = gcra_divmod(after, scale)
  redis.call('SET', key, gcra_value(now + ms, r, scale), 'PX', ms + (r > 0 and 1 or 0) + 1000)
end

-- One decision on `key` at `now` (unix ms): {allowed, remaining, retry_after_s, retry_ms,
-- now}. remaining: how many more requests of cost 1 the bucket admits at `now` after this
-- decision (on a refusal too: a refused cost of 5 may leave 3). retry_ms: on a refusal the
-- exact wait, rounded up to a whole ms, until this same request would be allowed (the
-- earliest t with max(TAT, t) + cost * T - t <= burst * T, i.e. t = TAT - (burst - cost) * T);
-- >= 1. retry_after_s = ceil(retry_ms / 1000). On allow both are 0.
-- `write`: store the new TAT on allow (false: a read-only look; the reply's 6th element is
-- then what gcra_store needs to store it later, nil on a refusal).
local function gcra_decide(key, now, interval, scale, burst, cost, write)
  local tat, rem = gcra_read(redis.call('GET', key), scale)
  local depth = burst * interval -- burst * T, in units
  local need = cost * interval   -- cost * T
  -- TAT' = max(TAT, now) as now + ahead ms + frac units.
  local ahead, frac = 0, 0
  if tat and (tat > now or (tat == now and rem > 0)) then ahead, frac = tat - now, rem end
  local used -- (TAT' - now) in units: nil when it is certainly more than depth
  if ahead <= math.floor(depth / scale) + 1 then used = ahead * scale + frac end
  if used and used + need <= depth then
    local after = used + need -- TAT_new - now, in units
    if write then
      gcra_store(key, now, after, scale)
      return {1, (gcra_divmod(depth - after, interval)), 0, 0, now}
    end
    return {1, (gcra_divmod(depth - after, interval)), 0, 0, now, after}
  end
  local remaining = 0
  if used and used <= depth then remaining = (gcra_divmod(depth - used, interval)) end
  -- The wait: ahead ms + (frac + need - depth) units, rounded up to a whole ms; the units'
  -- part may be negative (ceil of a negative quotient: minus the floor of its opposite).
  local excess = frac + need - depth
  local retry_ms
  if excess >= 0 then
    local q, r = gcra_divmod(excess, scale)
    retry_ms = ahead + q + (r > 0 and 1 or 0)
  else
    retry_ms = ahead - (gcra_divmod(-excess, scale))
  end
  return {0, remaining, math.floor((retry_ms + 999) / 1000), retry_ms, now}
end
