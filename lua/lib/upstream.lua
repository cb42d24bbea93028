--[[
lib/upstream.lua - what the provider behind a shared cap said about itself (an upstream's
view), and how an admission through the cap counts against it. Prepended by the build
(setup.py) to the scripts that decide; functions only. lua/observe_upstream.lua writes the
view.

One hash per shared scope, "{prefix}:{name}:upstream" (the cap's windows are
"{prefix}:{name}:{window_seconds}[:tokens]:shared"; on a Redis Cluster the name is the hash
tag of both, so they share a slot). Its fields:
  requests, requests_reset  the requests the provider has left, until that unix ms
  requests_limit            the provider's own limit (what it has again after its reset)
  requests_sent             requests admitted through the cap whose answer was not observed
                            yet: the provider's next word does not count them; counted
                            from requests_sent_at (unix ms) on, for at most `bound` ms (an
                            answer never observed stops counting then)
  tokens, tokens_reset, tokens_limit  the same for tokens
  closed_until              unix ms: the provider refused (429, 529) and said to come back then
  bound                     the operator's bound (ms), max_close_seconds; written by every
                            observation: a view without it was never heard from (cold)
  probe_out, probe_until    a cap that follows the provider (a call's probe spec, below)
                            and has no view: the probes admitted and still unanswered, and
                            when they stop counting (unix ms, the operator's probe timeout)
After a reset the provider has its limit again: the next admission starts a new view of
`limit` left for at most `bound` ms, which the provider's next word replaces. The key
expires `bound` ms after the last of its times: an upstream nobody heard from costs nothing.
The numbers were read from the provider's headers and bounded by the caller
(genai_ratelimit/provider_limits.py): no remaining above the provider's limit, no limit of
0, no reset or closure further away than the bound; so a header that lies can narrow or
close the cap for at most the bound, and never raise it (the windows still decide).

Cold start (a cap that follows the provider): before the provider's first answer nothing is
known, and a burst of more requests than the provider allows would meet its 429s. A call
names the caps that follow with a probe spec, "P p_1 t_1 p_2 t_2 ..." (one pair per shared
scope, in the order of their view keys; p = 0: the cap does not follow): while such a cap's
view was never heard from (no key, or a key without `bound`: never observed, or expired),
it admits at most p_k requests, the probes, until an observation writes the view; the
others are refused with a short wait (at most a second, at most until the probes stop
counting). A probe whose answer never comes stops counting t_k ms after the first probe of
its round (probe_until): nothing hangs. Once heard from, the provider's limit stays known
while the view lives (after its reset the cap admits against that limit again, see above),
so a cap goes cold again only when its view expired: no probe after every reset.
--]]

-- The longest wait (ms) a cold cap names while its probes are out: the probe's answer
-- usually comes sooner, and the cap cannot know when.
local PROBE_WAIT_MS = 1000

-- A call's probe spec (ARGV, "P p_1 t_1 ..."), or nil: {[k] = {probe, timeout_ms}} for the
-- k-th shared scope whose p_k > 0.
local function probe_spec(text)
  if not text or text:sub(1, 2) ~= 'P ' then return nil end
  local probes, k, numbers = {}, 0, {}
  for word in text:sub(3):gmatch('%S+') do numbers[#numbers + 1] = tonumber(word) end
  for j = 1, #numbers - 1, 2 do
    k = k + 1
    if numbers[j] and numbers[j] > 0 and numbers[j + 1] and numbers[j + 1] > 0 then
      probes[k] = {numbers[j], numbers[j + 1]}
    end
  end
  return probes
end

-- The resource ("requests", "tokens") of window key `key` when it is a window of the shared
-- scope whose keys start with `base`, else nil (the grammar of csrc/script.c window_key: the
-- window's digits, ":tokens" or not, ":shared", then the storage's suffix). lib/shares.lua
-- uses it too.
local function resource_in(key, base)
  if key:sub(1, #base) ~= base then return nil end
  local rest = key:sub(#base + 1)
  if rest:match('^:%d+:shared$') or rest:match('^:%d+:shared:c$') then return 'requests' end
  if rest:match('^:%d+:tokens:shared$') or rest:match('^:%d+:tokens:shared:c$') then
    return 'tokens'
  end
  return nil
end

-- The views of a decision's shared scopes: KEYS[first .. first + count - 1] are their
-- upstream keys (one EXISTS each: a cap nobody observed costs that and nothing else; an
-- observed one an HMGET more).
-- Returns nil when none says anything now, else an object with
--   check(reply): the decision's allowed reply (lib/decide.lua) turned into a refusal when
--     an upstream is closed or has less left than the request's cost (the wait: until the
--     closure ends or the provider's reset), else with its windows' remaining lowered to
--     what the provider has left; writes nothing;
--   charge(): the admitted request's cost counted against every view (a view past its
--     reset starts anew at the provider's limit), and the request counted as sent.
-- probe_text: the call's probe spec (see the header), or nil; a cold view of a cap that
-- follows refuses past its probes and counts the probe on charge.
local function open_upstreams(n, first, count, now, probe_text)
  if count == 0 then return nil end -- a check without a shared scope: nothing more is made
  local found, probes = nil, nil
  -- The probe of the k-th shared scope, the spec parsed only when a view is cold.
  local function probe_of(k)
    if not probe_text then return nil end
    probes = probes or probe_spec(probe_text)
    return probes and probes[k - first + 1]
  end
  for k = first, first + count - 1 do
    if redis.call('EXISTS', KEYS[k]) == 1 then
      found = found or {}
      local v = redis.call('HMGET', KEYS[k], 'closed_until', 'bound', 'requests',
        'requests_reset', 'requests_limit', 'tokens', 'tokens_reset', 'tokens_limit',
        'requests_sent_at')
      found[#found + 1] = {KEYS[k], v, not v[2] and probe_of(k) or nil}
    elseif probe_text then
      local probe = probe_of(k)
      if probe then -- a cap that follows, never heard from: its first probe
        found = found or {}
        found[#found + 1] = {KEYS[k], {}, probe}
      end
    end
  end
  if not found then return nil end -- nobody observed: the EXISTS were the whole cost
  local live = {}
  for _, entry in ipairs(found) do
    local key, v = entry[1], entry[2]
    local view = {key = key, closed = tonumber(v[1]) or 0, bound = tonumber(v[2]), left = {},
                  reset = {}, rolled = {}, sent_at = tonumber(v[9])}
    if entry[3] then -- cold (no `bound`): the probes out, this round's
      local out, until_ms = 0, 0
      if #v > 0 then -- the key exists (probes of this round, their requests_sent)
        local p = redis.call('HMGET', key, 'probe_out', 'probe_until')
        until_ms = tonumber(p[2]) or 0
        if until_ms > now then out = tonumber(p[1]) or 0 else until_ms = 0 end
      end
      view.probe = {limit = entry[3][1], timeout = entry[3][2], out = out, until_ms = until_ms}
    end
    for r, resource in ipairs({'requests', 'tokens'}) do
      local left, reset, limit = tonumber(v[3 * r]), tonumber(v[3 * r + 1]) or 0,
        tonumber(v[3 * r + 2])
      if left and reset > now then
        view.left[resource], view.reset[resource] = left, reset
      elseif limit then -- the provider said it has its limit again after its reset
        view.left[resource], view.rolled[resource] = limit, limit
      end
    end
    local base = key:sub(1, #key - #':upstream')
    view.windows = {}
    for i = 1, n do
      local resource = resource_in(KEYS[i], base)
      if resource then view.windows[#view.windows + 1] = {i, resource} end
    end
    live[#live + 1] = view
  end
  local charged = {}
  return {
    check = function(reply)
      local refusal, wait
      for _, view in ipairs(live) do
        for _, w in ipairs(view.windows) do
          local i, resource = w[1], w[2]
          local cost = tonumber(ARGV[3 * i + 2])
          local left = view.left[resource]
          local until_ms
          if view.closed > now then
            until_ms = view.closed
          elseif left and left < cost then
            until_ms = view.reset[resource] or now + view.bound
          elseif view.probe and view.probe.out >= view.probe.limit then
            until_ms = now + math.min(PROBE_WAIT_MS, view.probe.until_ms - now)
          end
          if until_ms and (not refusal or i < refusal) then refusal, wait = i, until_ms - now end
          charged[view.key .. ' ' .. resource] = {view, resource, cost}
          if left and left - cost >= 0 and left - cost < reply[6][i] then
            reply[6][i] = left - cost
          end
        end
      end
      if not refusal then return allowed_reply(n, now, reply[6]) end
      -- The windows before the refusing one report what they had (the cost given back).
      local remaining_of = {}
      for j = 1, refusal - 1 do
        remaining_of[j] = reply[6][j] + tonumber(ARGV[3 * j + 2])
      end
      remaining_of[refusal] = 0
      local window_ms = tonumber(ARGV[3 * refusal])
      wait = math.max(1, math.min(wait, window_ms + 86400000))
      return {0, 0, math.ceil(wait / 1000), refusal, now, remaining_of, wait}
    end,
    charge = function()
      for _, view in ipairs(live) do
        local probe = view.probe
        if probe then -- one probe more out, counted until the round's end
          if probe.out == 0 then
            redis.call('HSET', view.key, 'probe_out', 1, 'probe_until', now + probe.timeout)
            redis.call('PEXPIRE', view.key, probe.timeout) -- a cold key is the probes' own
          else
            redis.call('HINCRBY', view.key, 'probe_out', 1)
          end
        end
      end
      for _, c in pairs(charged) do
        local view, resource, cost = c[1], c[2], c[3]
        if view.rolled[resource] then
          redis.call('HSET', view.key, resource, view.rolled[resource] - cost,
                     resource .. '_reset', now + view.bound)
          redis.call('PEXPIRE', view.key, view.bound)
        elseif view.left[resource] then
          redis.call('HINCRBY', view.key, resource, -cost)
        end
        if resource == 'requests' then
          -- A cold view counts its probes on their way as long as they count as probes.
          local span = view.bound or (view.probe and view.probe.timeout)
          if view.rolled.requests or not view.sent_at or not span
              or now - view.sent_at >= span then
            redis.call('HSET', view.key, 'requests_sent', cost, 'requests_sent_at', now)
          else
            redis.call('HINCRBY', view.key, 'requests_sent', cost)
          end
        end
      end
    end,
  }
end
