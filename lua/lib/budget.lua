--[[
lib/budget.lua - calendar budgets with holds in flight: each budget counts units (requests,
tokens or money micro-units: the caller's amounts) in one period of a calendar (a day, a
week, a month in a time zone). Prepended by the build (setup.py) to the scripts that name
it in an "-- include:" line; it defines functions only.

One hash per budget and period, "{prefix}:{owner}:{period_start_ms}:budget={name}"
(script.c), holding
    spent    the period's settled total
    held     the sum of the holds in flight
    until    when the key expires, in the scripts' clock (its period's end + the longest
             hold): a hold with a longer hold_ms extends it, none shortens it
    <id>     one field per hold in flight: its amount (a UUID4: never another field's name)
    fired    soft limits: the highest threshold (a percent of the limit) already fired in
             this period (absent: none); fired_from the one before it, fired_by the call
             that fired it (the hold's id, or "s" .. id for its settle), so a replay of
             that call (its reply was lost) reports the same crossing and records nothing
so its memory is O(1) in the requests of the period (O(holds in flight)). Time zones stay
in Python (genai_ratelimit/periods.py): a script sees plain integers, the boundaries of
three periods per budget (the one the client's clock falls in and its two neighbours), and
picks the one that holds its own now (the server's TIME, or the client's clock).

A budget refuses an amount a when
    a > limit                        "permanent": it can never pass (kind 1)
    spent + a > limit                "until_reset": no room before the period ends (kind 2)
    spent + held + a > limit         "in_flight": room once holds settle (kind 3)
The kinds are tested in that order; the first budget that refuses names the refusal.

Soft limits: a budget's use is spent + held (what its admissions count). A hold allowed, or
a settle, that moves the use to or past one or more of its thresholds above `fired`
records the highest in `fired` and answers the crossing (fired before, fired now): decided
here, in one script, so once per period across every replica. A refusal fires nothing.
--]]

local BUDGET_FIELDS = 7 -- ARGV per budget: limit, amount, previous start, start, end, next
                        -- end, thresholds

-- The highest threshold of `packed` above `fired` that `use` reaches in a budget of
-- `limit`, or `fired` when none. packed: the percents (1..100, increasing) in groups of
-- three decimal digits, e.g. 50080095 for 50, 80, 95 (periods.py). Threshold t is reached
-- when use >= ceil(limit * t / 100), computed exactly below 2^53: limit = 100q + r.
local function budget_fired(packed, limit, use, fired)
  local r = math.fmod(limit, 100)
  local q = (limit - r) / 100
  local best = fired
  while packed > 0 do
    local t = math.fmod(packed, 1000)
    packed = (packed - t) / 1000
    if t > best and use >= q * t + math.ceil(r * t / 100) then best = t end
  end
  return best
end

-- A reply with the soft limits to tell: `reply` as it is when no budget crossed one (the
-- common case costs nothing more), else with {fired before} and {fired now} per budget
-- (a hold's reply gains two elements; a settle's integer becomes {found, {..}, {..}}).
local function budget_told(reply, n, before, after)
  for i = 1, n do
    if after[i] ~= before[i] then
      if type(reply) == 'table' then
        reply[#reply + 1] = before
        reply[#reply + 1] = after
        return reply
      end
      return {reply, before, after}
    end
  end
  return reply
end

-- The period of budget i (1-based) that holds `now`: (key, start, end), or nil when none
-- of the three does (the client's clock is a period or more away from the script's).
local function budget_period(i, now, first)
  local a = first + (i - 1) * BUDGET_FIELDS
  local previous, start = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local stop, following = tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5])
  if now < start then
    if now < previous then return nil end
    return KEYS[3 * i - 2], previous, start
  elseif now >= stop then
    if now >= following then return nil end
    return KEYS[3 * i], stop, following
  end
  return KEYS[3 * i - 1], start, stop
end

-- Decides a hold of budgets 1..n (ARGV from `first`, KEYS three per budget) under id at
-- now; on allow holds every amount, all or nothing. hold_ms: how long after its period's
-- end a key outlives it (the longest hold). Returns {allowed, refusing index (0-based, -1
-- on allow), kind, now, {remaining}, {period start}, {period end}}; {0, -1, 0, now, {}, {},
-- {}} when a budget's periods do not hold now (the caller recomputes them from now).
-- Two Redis calls per budget on allow (HMGET, HSET), one more when the key's life grows.
-- A reply that tells soft limits crossed has two more elements (budget_told).
-- replayed: the call carries proto.c's replay marker (its first reply was lost): a budget
-- whose id is held in any of its three periods answers from that period, so a replay that
-- crosses a boundary finds the hold its first attempt made instead of holding anew.
local function budget_hold(n, id, now, hold_ms, first, replayed)
  local keys, starts, ends, limits, amounts = {}, {}, {}, {}, {}
  local spent, held, untils, remaining = {}, {}, {}, {}
  local fired, before, after, packed = {}, {}, {}, {}
  for i = 1, n do
    local key, start, stop = budget_period(i, now, first)
    if not key then return {0, -1, 0, now, {}, {}, {}} end
    keys[i], starts[i], ends[i] = key, start, stop
    if replayed then
      local a = first + (i - 1) * BUDGET_FIELDS
      for j = 0, 2 do
        if redis.call('HEXISTS', KEYS[3 * i - 2 + j], id) == 1 then
          keys[i], starts[i], ends[i] = KEYS[3 * i - 2 + j], tonumber(ARGV[a + 2 + j]),
                                        tonumber(ARGV[a + 3 + j])
          break
        end
      end
    end
  end
  local refused, kind, replay = -1, 0, false
  for i = 1, n do
    local a = first + (i - 1) * BUDGET_FIELDS
    limits[i], amounts[i] = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
    packed[i] = tonumber(ARGV[a + 6])
    -- "until": the time (the scripts' clock) the key lives to, its TTL's end. The soft
    -- limits' fields are read only for a budget that has some.
    local values
    if packed[i] > 0 then
      values = redis.call('HMGET', keys[i], 'spent', 'held', 'until', id, 'fired', 'fired_from',
                          'fired_by')
    else
      values = redis.call('HMGET', keys[i], 'spent', 'held', 'until', id)
    end
    spent[i], held[i] = tonumber(values[1]) or 0, tonumber(values[2]) or 0
    untils[i] = tonumber(values[3]) or 0
    fired[i] = tonumber(values[5]) or 0
    before[i], after[i] = fired[i], fired[i]
    -- The replay of the hold that fired: its first reply (and crossing) was lost.
    if replayed and values[7] == id then before[i] = tonumber(values[6]) or 0 end
    -- A replay of a hold whose reply was lost: the id is already held, in every budget.
    if i == 1 and values[4] then replay = true end
    local k = 0
    if replay then
      k = 0
    elseif amounts[i] > limits[i] then
      k = 1
    elseif spent[i] + amounts[i] > limits[i] then
      k = 2
    elseif spent[i] + held[i] + amounts[i] > limits[i] then
      k = 3
    end
    if k > 0 and refused < 0 then refused, kind = i - 1, k end
    remaining[i] = math.max(0, limits[i] - spent[i] - held[i])
  end
  if refused >= 0 then
    return {0, refused, kind, now, remaining, starts, ends}
  end
  if replay then
    return budget_told({1, -1, 0, now, remaining, starts, ends}, n, before, after)
  end
  -- The first write is HSET, which Redis refuses over maxmemory before anything is
  -- written; once a script has written, Redis lets it finish.
  for i = 1, n do
    local target = ends[i] + hold_ms
    local fields = {'held', held[i] + amounts[i], id, amounts[i]}
    if packed[i] > 0 then
      after[i] = budget_fired(packed[i], limits[i], spent[i] + held[i] + amounts[i], fired[i])
      if after[i] > fired[i] then
        fields[5], fields[6], fields[7], fields[8] = 'fired', after[i], 'fired_from', fired[i]
        fields[9], fields[10] = 'fired_by', id
      end
    end
    if target > untils[i] then
      local n = #fields
      fields[n + 1], fields[n + 2] = 'until', target
    end
    redis.call('HSET', keys[i], unpack(fields))
    if target > untils[i] then
      -- Relative to the script's now (a client clock may differ from the server's): the
      -- key lives until its period's end plus hold_ms, never shortened by a later hold.
      redis.call('PEXPIRE', keys[i], target - now)
    end
    remaining[i] = math.max(0, remaining[i] - amounts[i])
  end
  return budget_told({1, -1, 0, now, remaining, starts, ends}, n, before, after)
end

-- Settles hold id in KEYS[1..n] (the periods that admitted it), budget i to actual
-- ARGV[first + 3(i - 1)] (then its limit and packed thresholds): spent += actual, held -=
-- the amount held, the hold's field removed. A hold no longer there (settled already, or
-- its key expired) is left alone, so a replay changes nothing. Returns the number of
-- budgets whose hold was found, or {found, {fired before}, {fired now}} when soft limits
-- were crossed (budget_told: the use, spent + held, grows when the actual exceeds the hold).
-- replayed (proto.c's marker: the first reply was lost): a budget whose crossing this
-- settle fired reports it again, so it is told once.
local function budget_settle(n, id, first, replayed)
  local found, before, after = 0, {}, {}
  for i = 1, n do
    local a = first + 3 * (i - 1)
    local packed = tonumber(ARGV[a + 2])
    before[i], after[i] = 0, 0
    if packed == 0 then -- no soft limits: nothing more than the settle itself
      local values = redis.call('HMGET', KEYS[i], 'spent', 'held', id)
      local amount = tonumber(values[3])
      if amount then
        -- HSET first: over maxmemory Redis refuses it before any write (see above).
        redis.call('HSET', KEYS[i], 'spent', (tonumber(values[1]) or 0) + tonumber(ARGV[a]),
                   'held', (tonumber(values[2]) or 0) - amount)
        redis.call('HDEL', KEYS[i], id)
        found = found + 1
      end
    else
      local values = redis.call('HMGET', KEYS[i], 'spent', 'held', id, 'fired', 'fired_from',
                                'fired_by')
      local amount = tonumber(values[3])
      local fired = tonumber(values[4]) or 0
      before[i], after[i] = fired, fired
      if amount then
        local spent = (tonumber(values[1]) or 0) + tonumber(ARGV[a])
        local held = (tonumber(values[2]) or 0) - amount
        after[i] = budget_fired(packed, tonumber(ARGV[a + 1]), spent + held, fired)
        if after[i] > fired then
          redis.call('HSET', KEYS[i], 'spent', spent, 'held', held, 'fired', after[i],
                     'fired_from', fired, 'fired_by', 's' .. id)
        else
          redis.call('HSET', KEYS[i], 'spent', spent, 'held', held)
        end
        redis.call('HDEL', KEYS[i], id)
        found = found + 1
      elseif replayed and values[6] == 's' .. id then
        before[i] = tonumber(values[5]) or 0
      end
    end
  end
  return budget_told(found, n, before, after)
end
