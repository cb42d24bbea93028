--[[
lib/shares.lua - reserved shares and ceilings of classes in a shared cap, decided in the
cap's own admission (sliding_window.lua). Prepended by the build (setup.py) after
lib/decide.lua, lib/upstream.lua (its resource_in) and the storage (its KEYS_PER_WINDOW);
functions only. genai_ratelimit/shares.py builds the spec and computes
every integer once; nothing here rounds.

The spec (ARGV[3n+3], before the optional replay marker), words separated by one space:
  S k c m name_1 .. name_m nw  then nw times: window_ms resource R_1 C_1 S_1 .. R_m C_m S_m
k: the scope's place among the call's shared scopes (its upstream view KEYS[KEYS_PER_WINDOW
* n + k] names its base); c: the request's class (1..m; 0: a class with no share, counted in
the cap only); resource "requests" or "tokens"; for class j in that window of limit L:
R_j the units it keeps for itself (its reserve), C_j its ceiling, S_j the saturation above
which the ceiling holds (C_j = S_j = L: no ceiling).

The rules, for the request's class c taking `cost` in a window of limit L and used `used`:
  reserve: used + cost <= L - sum over j ~= c of max(0, R_j - used_j)
  ceiling: when used + cost > S_c, used_c + cost <= C_c
where used_j is class j's use in the window, counted in its companion log:
  "{cap window key}:class={name}"    sorted set, score the entry's time (ms), member the entry's
  "{cap window key}:class={name}:w"  hash: each entry's cost, and "total" their sum
trimmed like the cap (entries at or before now - window_ms have left), written on allow in
the same script as the cap, expiring window_ms + 1 s after the last admission. They live
under the cap's name (its hash tag on a cluster), so in the cap's slot. Reconcile moves an
entry in them too (lib/set_cost.lua's set_class_costs).
--]]

-- The shares of a decision's spec, or nil without one. `log` is the storage (its
-- freeing_stamp gives a reserve refusal's wait). Returns an object with
--   check(reply): decide()'s allowed reply, turned into a refusal when a rule refuses the
--     request (the rule in .refused: 2j for class j's reserve, 2j + 1 for class j's
--     ceiling), else with each window's remaining lowered to what the class may still take;
--   charge(at): the admitted entry logged, at time `at`, in its class's companion logs.
local function open_shares(n, spec, now, log)
  if not spec then return nil end
  local t = {}
  for word in spec:gmatch('%S+') do t[#t + 1] = word end
  local k, c, m = tonumber(t[2]), tonumber(t[3]), tonumber(t[4])
  local names = {}
  for j = 1, m do names[j] = t[4 + j] end
  local pos = 5 + m
  local nw = tonumber(t[pos])
  pos = pos + 1
  local upstream = KEYS[KEYS_PER_WINDOW * n + k]
  local base = upstream:sub(1, #upstream - #':upstream')
  local rules = {}
  for _ = 1, nw do
    local rule = {reserve = {}, ceiling = {}, saturation = {}}
    for j = 1, m do
      local at = pos + 2 + 3 * (j - 1)
      rule.reserve[j], rule.ceiling[j], rule.saturation[j] =
        tonumber(t[at]), tonumber(t[at + 1]), tonumber(t[at + 2])
    end
    for i = 1, n do
      if ARGV[3 * i] == t[pos] and resource_in(KEYS[i], base) == t[pos + 1] then rules[i] = rule end
    end
    pos = pos + 2 + 3 * m
  end
  local function companion(i, j) return KEYS[i] .. ':class=' .. names[j] end

  -- Class j's use in window i, its companion trimmed first (by pages of 256 entries).
  local function class_used(key, window_ms)
    local weights = key .. ':w'
    while true do
      local gone = redis.call('ZRANGEBYSCORE', key, '-inf', now - window_ms, 'LIMIT', 0, 256)
      if #gone == 0 then break end
      local costs = redis.call('HMGET', weights, unpack(gone))
      local sum = 0
      for _, v in ipairs(costs) do sum = sum + (tonumber(v) or 0) end
      redis.call('ZREM', key, unpack(gone))
      redis.call('HDEL', weights, unpack(gone))
      redis.call('HINCRBY', weights, 'total', -sum)
      if #gone < 256 then break end
    end
    return tonumber(redis.call('HGET', weights, 'total')) or 0
  end

  -- The time of class j's oldest entry in window i whose leaving frees `need` of its use.
  local function class_freeing_stamp(key, need)
    local entries = redis.call('ZRANGE', key, 0, 63, 'WITHSCORES')
    if #entries == 0 then return nil end
    local members = {}
    for e = 1, #entries, 2 do members[#members + 1] = entries[e] end
    local costs = redis.call('HMGET', key .. ':w', unpack(members))
    local freed = 0
    for e = 1, #members do
      freed = freed + (tonumber(costs[e]) or 0)
      if freed >= need then return tonumber(entries[2 * e]) end
    end
    return nil
  end

  local shares = {refused = 0}
  function shares.check(reply)
    for i = 1, n do
      local rule = rules[i]
      if rule then
        local window_ms, limit, cost = window_of(i)
        local used = limit - cost - reply[6][i]
        local use = {}
        for j = 1, m do use[j] = class_used(companion(i, j), window_ms) end
        local held, holder, most = 0, 0, 0
        for j = 1, m do
          local unused = rule.reserve[j] - use[j]
          if j ~= c and unused > 0 then
            held = held + unused
            if unused > most then holder, most = j, unused end
          end
        end
        local code, stamp
        if used + cost > limit - held then
          code = 2 * holder
          stamp = log.freeing_stamp(i, window_ms, used + cost - (limit - held))
        elseif c > 0 and used + cost > rule.saturation[c] and use[c] + cost > rule.ceiling[c] then
          code = 2 * c + 1
          stamp = class_freeing_stamp(companion(i, c), use[c] + cost - rule.ceiling[c])
        end
        if code then
          local remaining_of = {}
          for j = 1, i - 1 do remaining_of[j] = reply[6][j] + tonumber(ARGV[3 * j + 2]) end
          remaining_of[i] = 0
          local retry, wait = wait_until_gone(stamp, window_ms, now)
          shares.refused = code
          return {0, 0, retry, i, now, remaining_of, wait}
        end
        if c > 0 then rule.used_by_class = use[c] end
        local left = limit - held - used - cost
        if c > 0 and used + cost > rule.saturation[c] then
          left = math.min(left, rule.ceiling[c] - use[c] - cost)
        end
        if left < reply[6][i] then reply[6][i] = left end
      end
    end
    return allowed_reply(n, now, reply[6])
  end

  function shares.charge(at)
    if c == 0 then return end
    for i = 1, n do
      if rules[i] then
        local window_ms, _, cost = window_of(i)
        local key = companion(i, c)
        redis.call('ZADD', key, at, ARGV[1])
        redis.call('HSET', key .. ':w', ARGV[1], cost, 'total', rules[i].used_by_class + cost)
        redis.call('PEXPIRE', key, window_ms + 1000)
        redis.call('PEXPIRE', key .. ':w', window_ms + 1000)
      end
    end
  end

  return shares
end
