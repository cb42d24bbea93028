--[[
lib/upstream.lua - what the provider behind a shared cap said about itself (an upstream's
view), and how an admission through the cap counts against it. Prepended by the build
(setup.py) to the scripts that name it; functions only.

One hash per shared scope, "{prefix}:{name}:upstream" (the cap's windows are
"{prefix}:{name}:{window_seconds}[:tokens]:shared"; on a Redis Cluster the name is the hash
tag of both, so they share a slot). Its fields, each present only while it says something:
  requests, requests_reset   the requests the provider has left, until that unix ms
  tokens, tokens_reset       the same for tokens
  closed_until               unix ms: the provider refused (429, 529) and said to come back then
The key expires when the last of those times has passed: an upstream nobody heard from
costs nothing. The numbers were read from the provider's headers and bounded by the caller
(genai_ratelimit/provider_limits.py): no remaining above the provider's limit, no reset or
closure further away than the operator's bound, so a header that lies can lower the cap
for at most that bound and never raise it.
--]]

-- Records one response's view (observe_upstream.lua): `left` and `reset_in` (ms from now)
-- per resource, -1 when the response did not say; `close_in` (ms), -1 when it did not
-- close the upstream. The provider's latest word on a resource replaces the view's; a
-- closure only ever lengthens. Returns closed_until (unix ms), 0 when open.
local function upstream_record(key, now, requests, requests_in, tokens, tokens_in, close_in)
  local view = redis.call('HMGET', key, 'requests_reset', 'tokens_reset', 'closed_until')
  local last = 0
  local function keep(at) if at and at > now and at > last then last = at end end
  local function record(field, left, reset_in, old_reset)
    if left >= 0 and reset_in > 0 then
      redis.call('HSET', key, field, left, field .. '_reset', now + reset_in)
      keep(now + reset_in)
    else
      keep(tonumber(old_reset))
    end
  end
  record('requests', requests, requests_in, view[1])
  record('tokens', tokens, tokens_in, view[2])
  local closed = tonumber(view[3]) or 0
  if close_in > 0 and now + close_in > closed then
    closed = now + close_in
    redis.call('HSET', key, 'closed_until', closed)
  end
  if closed <= now then closed = 0 end
  keep(closed)
  if last > 0 then
    redis.call('PEXPIRE', key, last - now)
  elseif redis.call('EXISTS', key) == 1 then
    redis.call('DEL', key) -- every time it held has passed: it says nothing any more
  end
  return closed
end

-- The resource ("requests", "tokens") of window key `key` when it is a window of the shared
-- scope whose keys start with `base`, else nil (the grammar of csrc/script.c window_key: the
-- window's digits, ":tokens" or not, ":shared", then the storage's suffix).
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
-- upstream keys (one HMGET each: a cap nobody observed costs that and nothing else).
-- Returns nil when none says anything now, else an object with
--   check(n, reply): the decision's allowed reply (lib/decide.lua) turned into a refusal when
--     an upstream is closed or has less left than the request's cost (the wait: until the
--     closure ends or the provider's reset), else with its windows' remaining lowered to
--     what the provider has left; writes nothing;
--   charge(): the admitted request's cost counted against every live view.
local function open_upstreams(n, first, count, now)
  local live = {}
  for k = first, first + count - 1 do
    local v = redis.call('HMGET', KEYS[k], 'closed_until', 'requests', 'requests_reset', 'tokens',
                         'tokens_reset')
    local view = {key = KEYS[k], closed = tonumber(v[1]) or 0,
                  left = {requests = tonumber(v[2]), tokens = tonumber(v[4])},
                  reset = {requests = tonumber(v[3]) or 0, tokens = tonumber(v[5]) or 0}}
    for _, resource in ipairs({'requests', 'tokens'}) do
      if not view.left[resource] or view.reset[resource] <= now then view.left[resource] = nil end
    end
    if view.closed > now or view.left.requests or view.left.tokens then
      local base = KEYS[k]:sub(1, #KEYS[k] - #':upstream')
      view.windows = {}
      for i = 1, n do
        local resource = resource_in(KEYS[i], base)
        if resource then view.windows[#view.windows + 1] = {i, resource} end
      end
      live[#live + 1] = view
    end
  end
  if #live == 0 then return nil end
  local charged = {}
  return {
    check = function(reply)
      local refusal, wait
      for _, view in ipairs(live) do
        for _, w in ipairs(view.windows) do
          local i, resource = w[1], w[2]
          local cost = tonumber(ARGV[3 * i + 2])
          local until_ms
          if view.closed > now then
            until_ms = view.closed
          elseif view.left[resource] and view.left[resource] < cost then
            until_ms = view.reset[resource]
          end
          if until_ms and (not refusal or i < refusal) then refusal, wait = i, until_ms - now end
          if view.left[resource] then
            charged[view.key .. ' ' .. resource] = {view.key, resource, cost}
            local after = view.left[resource] - cost
            if after >= 0 and after < reply[6][i] then reply[6][i] = after end
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
      for _, c in pairs(charged) do redis.call('HINCRBY', c[1], c[2], -c[3]) end
    end,
  }
end
