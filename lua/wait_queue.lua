-- include: lib/clock.lua
-- include: lib/queue.lua
--[[
wait_queue.lua - a ticket of a shared cap's wait queue taken, renewed or left (lib/queue.lua
holds the keys and the fairness rule; sliding_window.lua admits a ticket at its turn, and
lease.lua at an in-flight cap's).

KEYS[1]   the queue's sorted set, "{prefix}:{name}:queue" (an in-flight cap's:
          "{prefix}:{name}:leases:queue")
KEYS[2]   the queue's hash, "{prefix}:{name}:queue:h" (":leases:queue:h")
ARGV[1]   now in unix ms, or "" to read the server's clock (TIME)
ARGV[2]   the ticket (a UUID4: the member the request's admission logs)
ARGV[3]   the tenant (1 to 256 bytes)
ARGV[4]   take: the ms the ticket waits at most (> 0); 0: leave (remove the ticket)
ARGV[5]   take: the most live tickets of the queue; ARGV[6] the most of one tenant
ARGV[7]   take: the ticket's class's weight, its reserved share in basis points (1 to
          10000), or 0 when the cap has no shares (lib/queue.lua's queue_round: step 1);
          ARGV[8] the class's index (0 to 64; any when the weight is 0)

Returns, take: the ticket's rank (0: first), -1 when the queue holds its most tickets, -2
when the tenant does (nothing written then); a take of a ticket already held renews it: its
deadline becomes now + ARGV[4] when that is later (its place is kept), and its rank;
leave: 1 when the ticket was removed, 0 when it was not there (admitted, expired, left).
--]]

local now = script_now(ARGV[1], true)
local zkey, hkey, ticket, tenant = KEYS[1], KEYS[2], ARGV[2], ARGV[3]
local wait_ms = tonumber(ARGV[4])
local left = redis.call('EXISTS', zkey) == 1 and queue_purge(zkey, hkey, now) or 0 -- (its count)
local member = left > 0 and redis.call('HGET', hkey, 't|' .. ticket) or false
if wait_ms == 0 then
  if not member then return 0 end
  queue_remove(zkey, hkey, member)
  queue_forget(zkey, hkey)
  return 1
end
if member then
  -- A renewal (an in-flight cap's waiter keeps its short-lived ticket alive): the same
  -- round and arrival, a later deadline.
  local deadline, _, _, seq = queue_parse(member)
  if now + wait_ms > deadline then
    local renewed = string.format('%s|%d|%s|%s', seq, now + wait_ms, ticket, tenant)
    local round = redis.call('ZSCORE', zkey, member)
    redis.call('ZREM', zkey, member)
    redis.call('ZADD', zkey, round, renewed)
    redis.call('HSET', hkey, 't|' .. ticket, renewed)
    local expiry = math.max(redis.call('PTTL', zkey), wait_ms + 1000)
    redis.call('PEXPIRE', zkey, expiry)
    redis.call('PEXPIRE', hkey, expiry)
    member = renewed
  end
  return redis.call('ZRANK', zkey, member)
end
if left >= tonumber(ARGV[5]) then return -1 end
local state = redis.call('HMGET', hkey, 'n|' .. tenant, 'r|' .. tenant, 'seq')
local mine = tonumber(state[1]) or 0
if mine >= tonumber(ARGV[6]) then return -2 end
-- The round being served is the head's (tickets may be admitted out of order: a ticket
-- behind a sleeping one may pass when the windows hold both); a tenant's next ticket goes
-- the round after its latest, or its class's step (lib/queue.lua's queue_round).
local head = left > 0 and redis.call('ZRANGE', zkey, 0, 0, 'WITHSCORES') or {}
local round = queue_round(hkey, tonumber(head[2]), tenant, tonumber(state[2]),
                         tonumber(ARGV[7]) or 0, tonumber(ARGV[8]) or 0)
local seq = (tonumber(state[3]) or 0) + 1
local deadline = now + wait_ms
member = string.format('%012d|%d|%s|%s', seq, deadline, ticket, tenant)
round = string.format('%d', round) -- every digit (a number argument keeps 14)
redis.call('ZADD', zkey, round, member)
redis.call('HSET', hkey, 't|' .. ticket, member, 'n|' .. tenant, mine + 1,
           'r|' .. tenant, round, 'seq', seq)
local expiry = math.max(redis.call('PTTL', zkey), wait_ms + 1000)
redis.call('PEXPIRE', zkey, expiry)
redis.call('PEXPIRE', hkey, expiry)
return redis.call('ZRANK', zkey, member)
