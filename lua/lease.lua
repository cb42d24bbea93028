-- include: lib/clock.lua
-- include: lib/lease.lua
-- include: lib/shares.lua
-- include: lib/queue.lua
--[[
lease.lua - in-flight leases: at most `limit` concurrent holders per user, each slot
given back by release or, when its holder never comes back (process killed, connection
lost), by its own expiry. The build prepends the files named above (lib/lease.lua keeps
the leases) and embeds the whole in the C extension: the only copy.

KEYS[1]    the user's leases: a sorted set {lease id (UUID4 text) -> expiry, unix ms}
KEYS[2]    their stats: a hash of each held lease's start and the hold history that the
           refusal's hint comes from (lib/lease.lua)
KEYS[3]    the cap's wait queue: a sorted set of tickets (lib/queue.lua), "...:leases:queue";
           also the channel a release PUBLISHes the woken tickets on
KEYS[4]    the wait queue's hash, "...:leases:queue:h"
ARGV[1]    "acquire", "release" or "renew"
ARGV[2]    the lease id: a fresh UUID4 for acquire (or the caller's wait-queue ticket: the
           lease then has the ticket's id), the lease's own for release / renew
ARGV[3]    now in unix ms, or "" to read the server's clock (TIME)
ARGV[4]    acquire: the limit (concurrent holders); otherwise ignored
ARGV[5]    acquire / renew: the lease's length in ms; otherwise ignored
ARGV[6]    acquire, optional: the reserved shares of the cap, "L ..." (lib/shares.lua's
           lease_shares); the reply then has a 7th element: 0, or the rule that refused
           (2j: the reserve of class j, 2j + 1: class j's ceiling)
ARGV[6]    (or ARGV[7] after the shares) optional: "1" marks a replay after a lost reply.
           Ignored: every operation is idempotent by itself. acquire with a lease id
           already held answers "admitted" again, release removes at most once, renew of a
           held lease extends it again (and so in its class's leases).

Expired leases (expiry <= now) are dropped first, by every operation.

The wait queue (docs/wait-queue.md): while tickets wait, an acquire takes a slot only at its
turn, held + rank + 1 <= limit (rank: its ticket's, or the queue's length without one: no
barging); admitted, its ticket is removed, and when slots are still free the tickets
whose turn that makes are woken. A release, and leases found expired, wake the tickets at
the head (PUBLISH on KEYS[3], lib/queue.lua's queue_wake): one EXISTS when the queue is
empty.

Returns {ok, held, retry_ms, expires_ms, now_ms, bound_ms}:
  acquire allowed  -> {1, holders after this one, 0, this lease's expiry, now, 0}
  acquire refused  -> {0, holders, hint, 0, now, bound} (by the tickets ahead, with holders
                      below the limit: hint = bound = 1000): bound = max(1, soonest expiry -
                      now), the wait until the soonest lease expires (an upper bound: a
                      holder that releases frees its slot sooner); hint (1 <= hint <=
                      bound) the wait the hold history predicts (lib/lease.lua). Nothing
                      is written.
  release          -> {1 if the lease was held, holders after, 0, 0, now, 0}; the lease's
                      hold goes into the history
  renew            -> {1, holders, 0, new expiry, now, 0} when the lease is still held,
                      {0, holders, 0, 0, now, 0} when it expired or was released: a lease
                      whose slot may have gone to someone else never comes back.
The key expires with its latest lease (PEXPIRE, relative: right whichever clock decides),
the stats an hour later.
--]]

local key, op, id = KEYS[1], ARGV[1], ARGV[2]
local queue, queue_hash = KEYS[3], KEYS[4]

if op ~= 'release' then
  -- The OOM probe of sliding_window.lua: over maxmemory the script fails before it
  -- writes anything. Release has none: it only frees memory and must work then too.
  redis.call('ZADD', key, 'XX', 0, '')
end

local now = script_now(ARGV[3], true)
local held = leases(key, KEYS[2], now)

if op == 'release' then
  local removed = held.release(id)
  if removed == 1 then lease_class_moved(key, id, nil, now) end
  queue_wake(queue, queue_hash, now, removed + held.dropped)
  return {removed, held.count(), 0, 0, now, 0}
end

local lease_ms = tonumber(ARGV[5])

if op == 'renew' then
  local expires = held.renew(id, lease_ms)
  queue_wake(queue, queue_hash, now, held.dropped)
  if not expires then return {0, held.count(), 0, 0, now, 0} end
  lease_class_moved(key, id, expires, now)
  return {1, held.count(), 0, expires, now, 0}
end

-- acquire
local limit = tonumber(ARGV[4])
local shares = lease_shares(ARGV[6], key, now, limit, lease_ms)
local answer = held.may_acquire(id, limit, false, shares and shares.gate)
local waiting = 0
if answer[1] == 1 then
  answer, waiting = queue_admit_lease(queue, queue_hash, id, answer, limit, now)
end
local reply
if answer[1] == 0 then
  queue_wake(queue, queue_hash, now, held.dropped)
  reply = {0, answer[2], answer[3], 0, now, answer[5]}
else
  local expires = held.take(id, lease_ms, answer)
  if shares and answer[4] == 0 then shares.take(id, expires) end
  -- Slots still free while tickets wait: the next ones' turn came too (a second release
  -- before the head's waiter came published the head again, not them).
  if waiting > 0 and answer[2] < limit then
    queue_wake(queue, queue_hash, now, limit - answer[2])
  end
  reply = {1, answer[2], 0, expires, now, 0}
end
if shares then reply[7] = shares.refused end
return reply
