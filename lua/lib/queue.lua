--[[
lib/queue.lua - the wait queue of a shared cap (its windows) or of an in-flight cap (its
leases) (an upstream's caps): tickets of requests the
cap refused that wait for it to free, shared by every replica. Prepended by the build
(setup.py) to sliding_window.lua (the admission: no barging, a ticket's turn) and
wait_queue.lua (take a ticket, leave it); functions only. docs/wait-queue.md is the design.

Two keys per shared scope, under the scope's name (its hash tag on a Redis Cluster):
  "{prefix}:{name}:queue"    sorted set of the live tickets, in the order they are served:
                             score = the ticket's virtual round, member =
                             "<seq, 12 digits>|<deadline, unix ms>|<ticket>|<tenant>" (ties of
                             a round by arrival: the members sort by text, seq first)
  "{prefix}:{name}:queue:h"  hash: "t|<ticket>" -> the ticket's member; "n|<tenant>" -> the
                             tenant's live tickets; "r|<tenant>" -> the round of its latest;
                             "seq" -> the arrival counter
Fairness (virtual rounds, queue_round): without reserved shares (weight 0) a ticket is
served in round max(the head's round, the round of its tenant's latest live ticket + 1), so
each tenant has at most one ticket per round and a tenant with none waiting goes in the round
being served, behind at most one ticket of each other tenant; first in first out within a
tenant. With shares (docs/wait-queue.md, "Classes weighted by their shares") the ticket's
class c (an index, wait_queue.lua's ARGV[8]) weighs w_c basis points (1 to 10000, ARGV[7]),
its step is s_c = floor(QUEUE_STEP_SCALE / w_c) and the rounds are integers (exact in a
double's 53 bits): a tenant with live tickets goes in max(head, latest + s_c * n_c), n_c the
live tenants of its class (the class's share split evenly among them); a tenant with none in
max(head, v_c + s_c), v_c the round of its class's latest such first ticket. So under a
backlog each class is served about once per s_c rounds (in proportion to w_c), its waiting
tenants in turn, first in first out within a tenant. QUEUE_STEP_SCALE = 72072000 = 100 *
lcm(1..16): the steps of the whole percents that divide 720720 (1-16, 18, 20, 24, 30, 40, 60,
70, 80, 90, ...) are in exact ratio, any other within 1 part in 7207 (w = 10000: step 7207).
The hash's fields of a weighted queue also hold "c|<tenant>" -> the class its live tickets
count in (its first's), "k|<class>" -> the class's live tenants, "v|<class>" -> v_c.
Both keys expire 1 s after the latest
deadline of a ticket taken; a ticket whose deadline passed is purged by the next script that
reads the head of the queue (the first PURGE_SCAN tickets), so a waiter that was killed takes
no place once its deadline is over.

An in-flight cap (lease.lua, acquire's `limit` on a name such as an upstream's) has the same
two keys at "{prefix}:{name}:leases:queue" and ":h"; its tickets' deadlines are short (a few
seconds: a liveness the live waiter renews by taking its ticket again, wait_queue.lua), so a
killed waiter's ticket leaves the head within seconds. queue_admit_lease is its admission
(no barging: held + rank + 1 <= limit), queue_wake its wake-up: a script that frees slots
(a release, leases found expired) PUBLISHes on the channel named after the queue's sorted
set the tickets at the head that the freed slots make room for (space-separated).
--]]

local PURGE_SCAN = 64
-- The weighted rounds (above): step = floor(QUEUE_STEP_SCALE / weight in basis points).
local QUEUE_STEP_SCALE = 72072000
local QUEUE_MAX_WEIGHT = 10000
local QUEUE_MAX_CLASS = 64
-- The in-flight cap's queue (lease.lua): the wait a request refused for the tickets ahead of
-- it is told (they are admitted as their releases come; a plain acquire retries then).
local LEASE_QUEUE_HINT_MS = 1000

local function queue_parse(member)
  local seq, deadline, ticket, tenant = member:match('^(%d+)|(%d+)|([^|]+)|(.*)$')
  return tonumber(deadline), ticket, tenant, seq
end

-- The round of a new ticket of `tenant` (the rule of fairness, above): `head` the round of
-- the queue's head (nil when empty), `latest` the tenant's latest live ticket's (nil when
-- none), `weight` its class's share in basis points (0: no shares, step 1) and `class` its
-- index (0 to QUEUE_MAX_CLASS). A weighted first ticket of a tenant counts it in its class
-- (the hash's "c|", "k|", "v|" fields). Raises on a weight or a class out of range.
local function queue_round(hkey, head, tenant, latest, weight, class)
  if weight == 0 then return math.max(head or 0, (latest or 0) + 1) end
  if weight ~= math.floor(weight) or weight < 1 or weight > QUEUE_MAX_WEIGHT or
      class ~= math.floor(class) or class < 0 or class > QUEUE_MAX_CLASS then
    return error('a wait queue weight must be 0 to 10000 basis points, its class 0 to 64')
  end
  local step = math.floor(QUEUE_STEP_SCALE / weight)
  if latest then
    local counted = redis.call('HGET', hkey, 'c|' .. tenant) or tostring(class)
    local tenants = tonumber(redis.call('HGET', hkey, 'k|' .. counted)) or 1
    return math.max(head or 0, latest + step * tenants)
  end
  local round = math.max(head or 0, (tonumber(redis.call('HGET', hkey, 'v|' .. class)) or 0) + step)
  redis.call('HSET', hkey, 'c|' .. tenant, class, 'v|' .. class, string.format('%d', round))
  redis.call('HINCRBY', hkey, 'k|' .. class, 1)
  return round
end

-- Removes the ticket whose sorted-set member is `member` (its tenant's count and round; its
-- class's count of tenants when it was the tenant's last).
local function queue_remove(zkey, hkey, member)
  local _, ticket, tenant = queue_parse(member)
  redis.call('ZREM', zkey, member)
  redis.call('HDEL', hkey, 't|' .. ticket)
  if redis.call('HINCRBY', hkey, 'n|' .. tenant, -1) <= 0 then
    local class = redis.call('HGET', hkey, 'c|' .. tenant)
    if class and redis.call('HINCRBY', hkey, 'k|' .. class, -1) <= 0 then
      redis.call('HDEL', hkey, 'k|' .. class)
    end
    redis.call('HDEL', hkey, 'n|' .. tenant, 'r|' .. tenant, 'c|' .. tenant)
  end
end

-- An empty queue's hash: its counter and its classes' rounds go (every tenant's fields went
-- with its last ticket), so Redis deletes it (no DEL, HKEYS or HLEN: the documented ACL
-- lacks them). A hash left after "seq" holds "v|" rounds (a weighted queue's): all 65 go.
local QUEUE_CLASS_FIELDS = {}
for class = 0, QUEUE_MAX_CLASS do QUEUE_CLASS_FIELDS[class + 1] = 'v|' .. class end
local function queue_clear(hkey)
  redis.call('HDEL', hkey, 'seq')
  if redis.call('EXISTS', hkey) == 1 then redis.call('HDEL', hkey, unpack(QUEUE_CLASS_FIELDS)) end
end

-- The queue's hash forgets its counters once the sorted set is empty (Redis deletes an
-- empty sorted set and an empty hash by itself).
local function queue_forget(zkey, hkey)
  if redis.call('ZCARD', zkey) == 0 then queue_clear(hkey) end
end

-- Purges the expired tickets among the first PURGE_SCAN; both keys are gone once the queue
-- is empty. Returns the live tickets left (ZCARD) and the deadlines of the live ones among
-- the first PURGE_SCAN, in the queue's order.
local function queue_purge(zkey, hkey, now)
  local head = redis.call('ZRANGE', zkey, 0, PURGE_SCAN - 1)
  local deadlines = {}
  for _, member in ipairs(head) do
    local deadline = queue_parse(member)
    if deadline and deadline <= now then
      queue_remove(zkey, hkey, member)
    else
      deadlines[#deadlines + 1] = deadline
    end
  end
  local left = redis.call('ZCARD', zkey)
  if left == 0 then queue_clear(hkey) end
  return left, deadlines
end

-- The queues of a decision's shared scopes: KEYS[first + 2k], KEYS[first + 2k + 1] (k = 0 ..
-- count - 1) are the sorted set and the hash of the k-th one. One EXISTS each: a cap with an
-- empty queue costs that and nothing else. Returns nil when every queue is empty, else an
-- object with check(reply, log, n): the decision's allowed reply turned into a refusal when
-- tickets are ahead of this request (ARGV[1], the request's member, is its ticket when it
-- holds one; a request without one goes after every live ticket) and the windows cannot
-- hold them and it too; else the request's ticket is removed (admitted) and the reply kept.
-- The refusal waits until enough entries leave for the tickets ahead and this request
-- (lib/decide.lua's freeing_stamp over the windows' logs), the whole window when the
-- entries that would free it are not logged yet.
-- Whether window key `key` is a window of the shared scope whose keys start with `base`
-- (the grammar of csrc/script.c window_key, as lib/upstream.lua reads it).
local function queue_window_of(key, base)
  if key:sub(1, #base) ~= base then return false end
  local rest = key:sub(#base + 1)
  return rest:match('^:%d+:shared$') or rest:match('^:%d+:shared:c$') or
    rest:match('^:%d+:tokens:shared$') or rest:match('^:%d+:tokens:shared:c$') or false
end

-- The wait until the windows of the shared scope whose queue is `zkey` hold the `rank`
-- tickets ahead of a request (each of its cost) and it too: the longest over its windows
-- (the user's own windows are not theirs), given the decision's allowed `reply` and
-- freeing_stamp(i, window_ms, need) (the storage's). Returns (wait, at): the larger of
-- `wait` and this scope's, with its window (`at` kept when this scope needs less).
local function queue_room_wait(zkey, rank, reply, n, freeing_stamp, now, wait, at)
  local base = zkey:sub(1, #zkey - #':queue')
  for i = 1, rank > 0 and n or 0 do
    local window_ms, limit, cost = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1]),
      tonumber(ARGV[3 * i + 2])
    local used = limit - reply[6][i] - cost
    local need = used + cost * (rank + 1) - limit
    if need > 0 and cost > 0 and queue_window_of(KEYS[i], base) then
      local stamp = need <= used and freeing_stamp(i, window_ms, need) or nil
      local gone = stamp and stamp + window_ms - now or window_ms
      if gone < 1 then gone = 1 end
      if gone > wait then wait, at = gone, i end
    end
  end
  return wait, at
end

-- lib/decide.lua's refusal by window `at` after `wait` ms, from the allowed `reply`: what
-- the windows before it had.
local function queue_refusal(reply, at, wait, now)
  local remaining_of = {}
  for j = 1, at - 1 do remaining_of[j] = reply[6][j] + tonumber(ARGV[3 * j + 2]) end
  remaining_of[at] = 0
  return {0, 0, math.ceil(wait / 1000), at, now, remaining_of, wait}
end

local function open_queues(first, count, now)
  local found = nil
  for k = 0, count - 1 do
    local zkey, hkey = KEYS[first + 2 * k], KEYS[first + 2 * k + 1]
    if redis.call('EXISTS', zkey) == 1 then
      found = found or {}
      found[#found + 1] = {zkey, hkey}
    end
  end
  if not found then return nil end
  local queues = {}
  function queues.check(reply, log, n)
    local mine = {}
    local wait, at, expiry = 0, nil, nil -- the longest wait, its window; the soonest deadline
    for q, keys in ipairs(found) do
      local zkey, hkey = keys[1], keys[2]
      local left, deadlines = queue_purge(zkey, hkey, now)
      local member = left > 0 and redis.call('HGET', hkey, 't|' .. ARGV[1]) or false
      local rank = member and redis.call('ZRANK', zkey, member) or left
      mine[q] = member
      for k = 1, math.min(rank, #deadlines) do
        if not expiry or deadlines[k] < expiry then expiry = deadlines[k] end
      end
      wait, at = queue_room_wait(zkey, rank, reply, n, log.freeing_stamp, now, wait, at)
    end
    if at then
      -- A ticket ahead that expires (its waiter gone) frees its place then: wake no later.
      if expiry and expiry - now < wait then wait = math.max(1, expiry - now) end
      return queue_refusal(reply, at, wait, now)
    end
    for q, keys in ipairs(found) do
      if mine[q] then
        local zkey, hkey = keys[1], keys[2]
        queue_remove(zkey, hkey, mine[q])
        queue_forget(zkey, hkey)
      end
    end
    return reply
  end
  return queues
end

-- The in-flight cap's admission (lease.lua's acquire, after lib/lease.lua's may_acquire
-- allowed it: answer = {1, holders after it, 0, expiry of a replay or 0, 0}): with tickets
-- waiting, lease `id` (a ticket when it holds one, ARGV of the acquire) goes at its ticket's
-- rank, or after every live ticket without one, and takes a slot only when the holders and
-- the tickets ahead leave one: holders + rank + 1 <= limit. Admitted: its ticket is removed
-- and `answer` returned; else may_acquire's refusal shape {0, holders, hint, 0, bound}.
-- Second value: the live tickets left (0 when none wait). One EXISTS while the queue is
-- empty.
local function queue_admit_lease(zkey, hkey, id, answer, limit, now)
  if answer[4] ~= 0 or redis.call('EXISTS', zkey) == 0 then return answer, 0 end
  local left = queue_purge(zkey, hkey, now)
  if left == 0 then return answer, 0 end
  local member = redis.call('HGET', hkey, 't|' .. id)
  local rank = member and redis.call('ZRANK', zkey, member) or left
  local holders = answer[2] - 1
  if holders + rank + 1 > limit then
    return {0, holders, LEASE_QUEUE_HINT_MS, 0, LEASE_QUEUE_HINT_MS}, left
  end
  if member then
    queue_remove(zkey, hkey, member)
    queue_forget(zkey, hkey)
    left = left - 1
  end
  return answer, left
end

-- The in-flight cap's wake-up: `freed` slots came free (a release, leases found expired),
-- or an admission left slots free while tickets wait (two releases before the head's
-- waiter came: the next ticket's turn came too); when tickets wait, the first `freed` live
-- ones are PUBLISHed on the channel named `zkey` (their waiters ask again at once). One
-- EXISTS while the queue is empty.
local function queue_wake(zkey, hkey, now, freed)
  if freed < 1 or redis.call('EXISTS', zkey) == 0 then return end
  if queue_purge(zkey, hkey, now) == 0 then return end
  local tickets = {}
  for i, member in ipairs(redis.call('ZRANGE', zkey, 0, freed - 1)) do
    local _, ticket = queue_parse(member)
    tickets[i] = ticket
  end
  redis.call('PUBLISH', zkey, table.concat(tickets, ' '))
end
