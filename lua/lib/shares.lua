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

The rules (share_rule), for the request's class c taking `cost` in a window of limit L and
used `used`:
  reserve: used + cost <= L - sum over active j ~= c of max(0, R_j - used_j)
  ceiling: when another class is active and used + cost > S_c, used_c + cost <= C_c
Work-conserving: class j is active in window i while it has entries there, or sent a request
through the cap (admitted or refused) within window_ms; a request of no class counts as
another class (the cap holds entries of no class, or one came within window_ms). The latest
request of each class is in "{prefix}:{name}:shares:active" (class_activity: a hash {class,
or "" -> unix ms}, kept the longest window + 1 s): the one write a refused request makes.
where used_j is class j's use in the window, counted in its companion log:
  "{cap window key}:class={name}"    sorted set, score the entry's time (ms), member the entry's
  "{cap window key}:class={name}:w"  hash: each entry's cost, and "total" their sum
trimmed like the cap (entries at or before now - window_ms have left), written on allow in
the same script as the cap, expiring window_ms + 1 s after the last admission. They live
under the cap's name (its hash tag on a cluster), so in the cap's slot. Reconcile moves an
entry in them too (lib/set_cost.lua's set_class_costs).
In-flight caps (lease.lua, an acquire of the cap's name) take the same rule through
lease_shares, whose spec (ARGV[6] of lease.lua) is
  L c m name_1 .. name_m R_1 C_1 S_1 .. R_m C_m S_m
in slots of the acquire's limit L; used_j is class j's holders, counted in
  "{leases key}:class={name}"  sorted set {lease id -> expiry}: the class's leases, trimmed
                               like the leases key (expiry <= now: gone)
  "{leases key}:classes"       sorted set of the class names that hold (or held) leases
                               (scores 0), so that a release or a renew, which carry no
                               spec, find a lease's class (ZRANGE: docs/security.md's ACL)
  "{leases key}:active"        hash {class name, or "" for a request of no class -> until
                               when (ms) its latest acquire, admitted or refused, keeps it
                               active: that acquire's time + its lease_ms}
each kept as long as its longest lease (PEXPIRE, never shortened). Active there: class j
holds a slot, or asked for one within its own lease's length; a request of no class holds
one (the classes hold fewer than the cap) or asked within its lease's length.
--]]

-- The rule, once for window caps (open_shares) and in-flight caps (lease_shares). `rule`
-- holds per class j (1..m) reserve[j], ceiling[j], saturation[j] in units of the cap; the
-- request's class c (0: a class with no share) takes `cost` of a cap of `limit` whose use,
-- every class's before this request, is `used`; use[j] is class j's own use, active[j]
-- whether class j's reserve binds, `others` whether c's ceiling binds (another class is
-- active). Returns 0 and the room class c still has after this request, or the rule that
-- refuses (2j: class j's reserve, 2j + 1: class c's ceiling) and how much must free for
-- the request to pass (of the cap's use for a reserve, of class c's own for a ceiling).
local function share_rule(rule, c, limit, used, cost, use, active, others)
  local held, holder, most = 0, 0, 0
  for j = 1, #use do
    local unused = rule.reserve[j] - use[j]
    if j ~= c and unused > 0 and active[j] then
      held = held + unused
      if unused > most then holder, most = j, unused end
    end
  end
  if used + cost > limit - held then return 2 * holder, used + cost - (limit - held) end
  local ceiling_binds = c > 0 and others and used + cost > rule.saturation[c]
  if ceiling_binds and use[c] + cost > rule.ceiling[c] then
    return 2 * c + 1, use[c] + cost - rule.ceiling[c]
  end
  local left = limit - held - used - cost
  if ceiling_binds then left = math.min(left, rule.ceiling[c] - use[c] - cost) end
  return 0, left
end

-- Key `key` kept at least `ms` more (PEXPIRE, never shortened).
local function keep_at_least(key, ms)
  local ttl = redis.call('PTTL', key)
  if ttl < ms then redis.call('PEXPIRE', key, ms) end
end

-- The activity of a cap's classes, kept in hash `key` {class name, or "" for requests of
-- no class -> a time, ms}: returns each of the m classes' value and (m + 1) that of ""
-- (nil where none), then sets the request's class c's (0: "") to `stamp`; the hash is kept
-- at least `keep_ms` more. The one write a refused request makes: a class a cap refused
-- is waiting, and its reserve must bind for the room that frees next.
local function class_activity(key, names, c, stamp, keep_ms)
  local fields = {}
  for j = 1, #names do fields[j] = names[j] end
  fields[#names + 1] = ''
  local seen = redis.call('HMGET', key, unpack(fields))
  local out = {}
  for j = 1, #names + 1 do out[j] = tonumber(seen[j]) end
  redis.call('HSET', key, c > 0 and names[c] or '', stamp)
  keep_at_least(key, keep_ms)
  return out
end

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
  local longest = 0
  for i = 1, n do
    if rules[i] then longest = math.max(longest, window_of(i)) end
  end
  -- Each class's latest request through the cap (ms), admitted or refused; this one's now.
  local seen = class_activity(base .. ':shares:active', names, c, now, longest + 1000)

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
        -- Work-conserving: class j is active in this window when it has entries in it or
        -- sent a request within it; a request of no class when the cap holds entries of no
        -- class or one came within it.
        local use, active, classed = {}, {}, 0
        for j = 1, m do
          use[j] = class_used(companion(i, j), window_ms)
          classed = classed + use[j]
          active[j] = use[j] > 0 or (seen[j] ~= nil and seen[j] > now - window_ms)
        end
        local others = used > classed or (seen[m + 1] ~= nil and seen[m + 1] > now - window_ms)
        for j = 1, m do
          if j ~= c and active[j] then others = true end
        end
        local code, need = share_rule(rule, c, limit, used, cost, use, active, others)
        local stamp
        if code > 0 and code % 2 == 0 then
          stamp = log.freeing_stamp(i, window_ms, need)
        elseif code > 0 then
          stamp = class_freeing_stamp(companion(i, c), need)
        end
        if code > 0 then
          local remaining_of = {}
          for j = 1, i - 1 do remaining_of[j] = reply[6][j] + tonumber(ARGV[3 * j + 2]) end
          remaining_of[i] = 0
          local retry, wait = wait_until_gone(stamp, window_ms, now)
          shares.refused = code
          return {0, 0, retry, i, now, remaining_of, wait}
        end
        if c > 0 then rule.used_by_class = use[c] end
        if need < reply[6][i] then reply[6][i] = need end
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

-- The shares of an in-flight cap's acquire (lease.lua) for `spec` ("L ...", see the
-- header), or nil without one: `leases` the cap's leases key, `limit` its slots, `lease_ms`
-- the lease's length (the span a class stays active). Opening reads every class's holders
-- and latest acquire, then stamps the request's class active (whatever the answer). Returns
-- an object with
--   gate(count): for lib/lease.lua's may_acquire, when the cap has room (count holders):
--     nil to admit, or true and the expiry that frees a slot for it (nil: none held), the
--     rule kept in .refused (2j: class j's reserve, 2j + 1: class j's ceiling);
--   take(id, expires): the admitted lease added to its class's leases.
local function lease_shares(spec, leases, now, limit, lease_ms)
  if not spec or spec:sub(1, 2) ~= 'L ' then return nil end
  local t = {}
  for word in spec:gmatch('%S+') do t[#t + 1] = word end
  local c, m = tonumber(t[2]), tonumber(t[3])
  local names, rule = {}, {reserve = {}, ceiling = {}, saturation = {}}
  for j = 1, m do
    names[j] = t[3 + j]
    local at = 4 + m + 3 * (j - 1)
    rule.reserve[j], rule.ceiling[j], rule.saturation[j] =
      tonumber(t[at]), tonumber(t[at + 1]), tonumber(t[at + 2])
  end
  local function class_key(j) return leases .. ':class=' .. names[j] end
  local active_key = leases .. ':active'

  local use = {}
  for j = 1, m do
    redis.call('ZREMRANGEBYSCORE', class_key(j), '-inf', now)
    use[j] = redis.call('ZCARD', class_key(j))
  end
  -- Until when each class (m + 1: requests of no class) is active; this one for its lease.
  local seen = class_activity(active_key, names, c, now + lease_ms, lease_ms)
  local active = {}
  for j = 1, m + 1 do
    active[j] = (use[j] or 0) > 0 or (seen[j] ~= nil and seen[j] > now)
  end

  local shares = {refused = 0}
  function shares.gate(count)
    local classed = 0
    for j = 1, m do classed = classed + use[j] end
    -- Another class is active: one of the m (not c), or a request of no class (one holds a
    -- slot when the classes hold fewer than the cap's holders).
    local others = c > 0 and (active[m + 1] or count > classed)
    for j = 1, m do
      if j ~= c and active[j] then others = true end
    end
    local code = share_rule(rule, c, limit, count, 1, use, active, others)
    if code == 0 then return nil end
    shares.refused = code
    local soonest = nil
    if code % 2 == 1 then -- a slot of its own class frees it
      soonest = tonumber(redis.call('ZRANGE', class_key(c), 0, 0, 'WITHSCORES')[2])
    end
    -- No lease to wait for (a reserve of an idle class, a ceiling of 0): its span.
    if not soonest and count == 0 then soonest = now + lease_ms end
    return true, soonest
  end

  function shares.take(id, expires)
    if c == 0 then return end
    local key = class_key(c)
    redis.call('ZADD', key, expires, id)
    redis.call('ZADD', leases .. ':classes', 0, names[c])
    keep_at_least(key, expires - now)
    keep_at_least(leases .. ':classes', expires - now)
  end

  return shares
end

-- A lease's release or renewal (lease.lua) carried to its class's leases: `expires` nil
-- removes lease `id`, else moves its expiry there. The classes set names where it may be.
local function lease_class_moved(leases, id, expires, now)
  local names = redis.call('ZRANGE', leases .. ':classes', 0, -1)
  for _, name in ipairs(names) do
    local key = leases .. ':class=' .. name
    if expires then
      if redis.call('ZADD', key, 'XX', 'CH', expires, id) == 1 then
        keep_at_least(key, expires - now)
        keep_at_least(leases .. ':classes', expires - now)
        return
      end
    elseif redis.call('ZREM', key, id) == 1 then
      return
    end
  end
end
