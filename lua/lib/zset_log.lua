--[[
lib/zset_log.lua - the sliding-window log kept in sorted sets (storage "zset", the
default). Prepended by the build (setup.py) to the scripts that name it; functions only.

KEYS[i]     (i = 1..n) window i's sorted set {UUID4 member -> request time, unix ms}
KEYS[n+i]   its weights: a hash {member -> cost} of its entries whose cost is not 1, and
            field "" = the sum of (cost - 1) over them. It exists only while such an entry
            does, so a window of plain entries costs one HGET more.
KEYS[2n+i]  its running totals, while the weights exist: a sorted set {member -> the
            cumulative cost of the window's entries up to and including it, in the set's
            order} of the weighted entries, and member "" -> the cumulative cost of every
            entry trimmed so far (the origin is arbitrary; only differences count). Costs
            are >= 1, so the totals grow with the order, and the entry whose leaving frees
            `need` units is found by one ZRANGEBYSCORE, not by walking the entries. An
            entry of cost 1 needs no total of its own: between two weighted entries each
            adds 1, so its total follows from its rank.

used = ZCARD + the weights' "" field: the sum of the costs in the window. An entry at or
before now - window_ms has left the window.

The totals are checked before a search uses them (the last weighted entry's total, plus
one per entry after it, must be the window's whole cost): a window written by an earlier
version of this library, which kept no totals, gets them built once (O(entries)) by a
script that may write, and is walked entry by entry by a read-only one (peek).
--]]

-- The running totals a reconcile reads at once from the end (a few: each costs the server
-- about 0.3 µs in the reply, as much as a command for four): its entry's and the ones after
-- it are usually among them (the requests that came in while it ran).
local RECENT_TOTALS = 4

-- The functions of the weighted windows, and of the calls other than a check's decision
-- (peek's look, reconcile's set_cost): built by zset_log at their first need in an
-- execution, so that a check over plain windows creates none of these closures (a script's
-- functions are made anew on every execution, each closure several hundred to a couple of
-- thousand server instructions with its upvalues). `now` is the call's time; `probed`: the
-- OOM probe has run (or is not wanted), else trim runs it before its first write (see
-- zset_log).
local function zset_weighted(n, now, probed)
  local long = {} -- the long way
  -- Per window measured: the weights' total of the entries still in the window; how many
  -- of the first entries (by rank) have left it but are still in the set (0 after a
  -- trim); the running total up to and including the last of those (the first live
  -- entry's total is it plus its cost), nil when the window has no totals.
  local extra_of, gone_of, dead_total_of, checked_of = {}, {}, {}, {}
  local count_of = {} -- per window trimmed: the entries left in its set

  local function keys_of(i)
    return KEYS[i], KEYS[n + i], KEYS[2 * n + i]
  end

  -- The weights' total of the `count` entries from rank 0; removes their weights when
  -- `drop` (they are being trimmed). In batches: Lua's unpack() takes a few thousand
  -- values at most.
  local function weights_of_first(i, count, drop)
    local key, weights = keys_of(i)
    local freed = 0
    for from = 0, count - 1, 1000 do
      local last = from + 999
      if last >= count then last = count - 1 end
      local leaving = redis.call('ZRANGE', key, from, last)
      local costs = redis.call('HMGET', weights, unpack(leaving))
      local weighted = {}
      for j = 1, #leaving do
        if costs[j] then
          freed = freed + tonumber(costs[j]) - 1
          weighted[#weighted + 1] = leaving[j]
        end
      end
      if drop and #weighted > 0 then redis.call('HDEL', weights, unpack(weighted)) end
    end
    return freed
  end

  -- True when window i's totals agree with its set: `base` is the totals' "" and `extra`
  -- the weights' "" over every entry of the set.
  local function totals_agree(i, base, extra)
    local key, _, totals = keys_of(i)
    if not base then return false end
    local last = redis.call('ZRANGE', totals, -1, -1, 'WITHSCORES')
    if last[1] == '' then return extra == 0 end
    local rank = redis.call('ZRANK', key, last[1])
    if not rank then return false end
    local count = redis.call('ZCARD', key)
    return tonumber(last[2]) + count - 1 - rank == base + count + extra
  end

  -- Builds window i's totals from its set and weights (O(entries)): the origin is the
  -- window's first entry. The totals live as long as the set.
  local function build_totals(i)
    local key, weights, totals = keys_of(i)
    redis.call('ZREMRANGEBYRANK', totals, 0, -1)
    local count, total = redis.call('ZCARD', key), 0
    for from = 0, count - 1, 1000 do
      local members = redis.call('ZRANGE', key, from, from + 999)
      local costs = redis.call('HMGET', weights, unpack(members))
      local add = {}
      for j = 1, #members do
        total = total + (tonumber(costs[j]) or 1)
        if costs[j] then
          add[#add + 1] = total
          add[#add + 1] = members[j]
        end
      end
      if #add > 0 then redis.call('ZADD', totals, unpack(add)) end
    end
    redis.call('ZADD', totals, 0, '')
    local ttl = redis.call('PTTL', key)
    if ttl > 0 then redis.call('PEXPIRE', totals, ttl) end
  end

  -- The running total of the entry at rank r of window i (r = -1: before the first),
  -- from the last weighted entry at or before it: a binary search over the totals by
  -- rank (O(log^2 entries)).
  local function total_at_rank(i, r)
    local key, _, totals = keys_of(i)
    local low, high = 1, redis.call('ZCARD', totals) - 1 -- rank 0 is ""
    local found, found_rank = nil, nil
    while low <= high do
      local middle = math.floor((low + high) / 2)
      local entry = redis.call('ZRANGE', totals, middle, middle, 'WITHSCORES')
      local rank = redis.call('ZRANK', key, entry[1])
      if rank <= r then
        found, found_rank, low = tonumber(entry[2]), rank, middle + 1
      else
        high = middle - 1
      end
    end
    if found then return found + r - found_rank end
    return tonumber(redis.call('ZSCORE', totals, '')) + r + 1
  end

  -- Drops the entries that left window i, whose weights' "" field is `extra` (the caller
  -- read it: a number, the window holds weighted entries); returns its used cost. The OOM
  -- probe first when it has not run: this trim's writes may come first.
  function long.trim(i, window_ms, extra)
    local key, weights, totals = keys_of(i)
    if not probed then
      redis.call('ZADD', KEYS[1], 'XX', 0, '')
      probed = true
    end
    local dead_total = nil
    local gone = nil
    if extra then
      -- Weighted entries may be leaving: take their weight off the total first.
      gone = redis.call('ZCOUNT', key, '-inf', now - window_ms)
      local freed = weights_of_first(i, gone, true)
      if freed > 0 then
        extra = extra - freed
        if extra > 0 then
          redis.call('HSET', weights, '', extra)
        else
          redis.call('HDEL', weights, '')
          extra = 0
        end
      end
      dead_total = tonumber(redis.call('ZSCORE', totals, ''))
      if extra == 0 then
        redis.call('ZREMRANGEBYRANK', totals, 0, -1)
        dead_total = nil
      elseif dead_total and gone > 0 then
        -- The leaving entries' totals are the ones up to the new origin.
        dead_total = dead_total + gone + freed
        redis.call('ZREMRANGEBYSCORE', totals, '-inf', dead_total)
        redis.call('ZADD', totals, dead_total, '')
      end
    else
      extra = 0
    end
    if gone ~= 0 then redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window_ms) end
    local count = redis.call('ZCARD', key)
    extra_of[i], gone_of[i], dead_total_of[i], checked_of[i] = extra, 0, dead_total, false
    count_of[i] = count
    return count + extra
  end

  -- Window i as trim would leave it, without writing: its used cost and its oldest
  -- entry's time (nil when empty). The entries at or before now - window_ms count as
  -- gone, and so do their weights.
  function long.look(i, window_ms)
    local key, weights, totals = keys_of(i)
    local gone = redis.call('ZCOUNT', key, '-inf', now - window_ms)
    local extra = tonumber(redis.call('HGET', weights, ''))
    local dead_total = nil
    if extra then
      local base = tonumber(redis.call('ZSCORE', totals, ''))
      if totals_agree(i, base, extra) then
        dead_total = base + gone
        if gone > 0 then dead_total = total_at_rank(i, gone - 1) end
        extra = extra - (dead_total - base - gone)
      else
        extra = extra - weights_of_first(i, gone, false)
      end
      if extra < 0 then extra = 0 end
    else
      extra = 0
    end
    extra_of[i], gone_of[i], dead_total_of[i], checked_of[i] = extra, gone, dead_total, true
    local oldest = redis.call('ZRANGE', key, gone, gone, 'WITHSCORES')[2]
    return redis.call('ZCARD', key) - gone + extra, oldest and tonumber(oldest)
  end

  -- The entry freeing `need` units found by walking the live entries 64 at a time: for
  -- a window whose totals a read-only script cannot build.
  local function walk_to(i, need)
    local key, weights = keys_of(i)
    local freed, from = 0, gone_of[i]
    while true do
      local batch = redis.call('ZRANGE', key, from, from + 63, 'WITHSCORES')
      if #batch == 0 then return nil end
      local members = {}
      for j = 1, #batch, 2 do members[#members + 1] = batch[j] end
      local costs = redis.call('HMGET', weights, unpack(members))
      for j = 1, #members do
        freed = freed + (tonumber(costs[j]) or 1)
        if freed >= need then return tonumber(batch[2 * j]) end
      end
      from = from + 64
    end
  end

  -- The time of window i's oldest entry (after the ones gone) whose leaving frees `need`
  -- units, or nil when none does. Uses what the last trim or look of window i found;
  -- `writes`: the script may build totals that are missing.
  local function freeing_stamp(i, need, writes)
    local key, _, totals = keys_of(i)
    local gone = gone_of[i]
    if extra_of[i] == 0 then
      -- Every entry costs 1: the need-th oldest is the one.
      local score = redis.call('ZRANGE', key, gone + need - 1, gone + need - 1, 'WITHSCORES')[2]
      return score and tonumber(score)
    end
    local dead = dead_total_of[i]
    if dead and not checked_of[i] and not totals_agree(i, dead, extra_of[i]) then
      dead = nil -- after a trim, which keeps them without checking (look checks them)
    end
    if not dead then
      if not writes then return walk_to(i, need) end
      build_totals(i) -- the window was trimmed: no entry has left it
      dead = 0
    end
    local target = dead + need
    local hit = redis.call('ZRANGEBYSCORE', totals, target, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local before
    if hit[1] then
      local index = redis.call('ZRANK', totals, hit[1])
      before = redis.call('ZRANGE', totals, index - 1, index - 1, 'WITHSCORES')
    else
      before = redis.call('ZRANGE', totals, -1, -1, 'WITHSCORES')
    end
    -- The entries between `before` and `hit` cost 1 each: the one at `target` is the
    -- (target - before's total)-th after `before`, unless `hit` comes first.
    local before_rank = before[1] == '' and -1 or redis.call('ZRANK', key, before[1])
    local rank = before_rank + target - tonumber(before[2])
    local bound = hit[1] and redis.call('ZRANK', key, hit[1]) or redis.call('ZCARD', key)
    if rank < bound then
      return tonumber(redis.call('ZRANGE', key, rank, rank, 'WITHSCORES')[2])
    end
    return hit[1] and tonumber(redis.call('ZSCORE', key, hit[1])) or nil
  end

  function long.freeing_stamp(i, _, need)
    return freeing_stamp(i, need, true)
  end

  -- peek's: never writes (a window without totals is walked).
  function long.peek_freeing_stamp(i, _, need)
    return freeing_stamp(i, need, false)
  end

  -- Adds `delta` to the totals of window i's weighted entries after the total `after`
  -- (the entries after one whose cost changed or that came in before them).
  -- `also`: {total, member} pairs to write in the same ZADD (or nil). Two commands
  -- whatever the number of entries moved (in batches: unpack() takes a few thousand values).
  local function shift_totals_after(i, after, delta, also)
    local _, _, totals = keys_of(i)
    local later = redis.call('ZRANGEBYSCORE', totals, '(' .. after, '+inf', 'WITHSCORES')
    local pairs_out = also or {}
    for j = 1, #later, 2 do
      pairs_out[#pairs_out + 1] = tonumber(later[j + 1]) + delta
      pairs_out[#pairs_out + 1] = later[j]
      if #pairs_out >= 2000 then
        redis.call('ZADD', totals, unpack(pairs_out))
        pairs_out = {}
      end
    end
    if #pairs_out > 0 then redis.call('ZADD', totals, unpack(pairs_out)) end
  end

  -- The weights and running totals of `member`, just logged at now in window i (trimmed)
  -- with `cost`, whose weighted entries' total was `extra` (the weights' "" field as it is
  -- now) and totals' origin `before` (nil: no totals) before it; the set holds `count`
  -- entries with it; the keys live `seconds`. The entry's weight and the new "" go in one
  -- HSET, the origin and the entry's total in one ZADD.
  function long.weigh(i, member, cost, seconds, extra, before, count)
    local key, weights, totals = keys_of(i)
    local weighted = extra > 0
    local origin = false -- the totals start here: their "" (origin 0) is still to write
    if cost ~= 1 then
      redis.call('HSET', weights, member, cost, '', extra + cost - 1)
      redis.call('EXPIRE', weights, seconds)
      if not weighted then
        -- The window's first weighted entry: its totals start here (origin 0).
        redis.call('ZREMRANGEBYRANK', totals, 0, -1)
        origin, before = true, 0
      end
    end
    if not before or not (weighted or cost ~= 1) then return end
    local rank = redis.call('ZRANK', key, member)
    local after = count - 1 - rank
    if after > 0 and after <= RECENT_TOTALS then
      -- Not the last, but close (the same millisecond as a later member, usually): the
      -- window's cost up to the last entry is known (below), so its total is that less the
      -- costs of the entries after it, and theirs follow from it; one ZADD writes them.
      local later = redis.call('ZRANGE', key, rank + 1, -1)
      local costs = redis.call('HMGET', weights, unpack(later))
      local total = before + count - 1 + extra + cost
      for j = 1, #later do total = total - (tonumber(costs[j]) or 1) end
      local moved = {}
      if origin then moved = {0, ''} end
      if cost ~= 1 then
        moved[#moved + 1] = total
        moved[#moved + 1] = member
      end
      for j = 1, #later do
        total = total + (tonumber(costs[j]) or 1)
        if costs[j] then
          moved[#moved + 1] = total
          moved[#moved + 1] = later[j]
        end
      end
      if #moved > 0 then redis.call('ZADD', totals, unpack(moved)) end
    elseif after > 0 then
      -- Not the last (another client's clock behind, say): the totals after it grow by
      -- its cost.
      if origin then redis.call('ZADD', totals, 0, '') end
      local total = total_at_rank(i, rank - 1) + cost
      shift_totals_after(i, total - cost, cost, cost ~= 1 and {total, member} or nil)
    elseif cost ~= 1 then
      -- The window's cost up to here is the origin plus what the trim left and this cost.
      local total = before + count - 1 + extra + cost
      if origin then
        redis.call('ZADD', totals, 0, '', total, member)
      else
        redis.call('ZADD', totals, total, member)
      end
    end
    redis.call('EXPIRE', totals, seconds)
  end

  -- Logs `member` at now in window i with `cost`; the keys live window_ms + 1 s. Called
  -- after the decision trimmed the window (trim's findings are used).
  function long.add(i, member, cost, window_ms)
    local key = KEYS[i]
    local seconds = window_ms / 1000 + 1
    local added = redis.call('ZADD', key, now, member)
    redis.call('EXPIRE', key, seconds)
    long.weigh(i, member, cost, seconds, extra_of[i], dead_total_of[i], count_of[i] + added)
  end

  -- Sets the cost of the entry `member` logged at `score` in window i to `cost` (0
  -- removes it), when it is still there with that score and has not left the window (the
  -- tie, a compact log's, is not needed).
  -- Returns 1 when it was, else 0. Setting the same cost twice changes nothing. The
  -- totals of the weighted entries after it move by the difference (one read and one
  -- write, O(those entries) on the server). An entry already weighted costs five commands
  -- or so: its time, its weight and the window's "" (one HMGET), its total, the new weight
  -- and "" (one HSET), the totals after it and its own (a ZRANGEBYSCORE and one ZADD).
  function long.set_cost(i, member, score, _, cost, window_ms)
    local key, weights, totals = keys_of(i)
    local logged = tonumber(redis.call('ZSCORE', key, member))
    if logged ~= score or score <= now - window_ms then return 0 end
    local stored = redis.call('HMGET', weights, member, '')
    local old = tonumber(stored[1]) or 1
    local new = cost
    if new == old then return 1 end
    local extra = tonumber(stored[2]) or 0
    -- The entry's running total before the change, when there are totals to keep (a
    -- window without them, written by an older version, gets them at its next search;
    -- totals that disagree are rebuilt there too).
    local total, later = nil, nil -- later: {total, member, ...} of the weighted entries after
    if extra == 0 and cost == 0 and old == 1 then
      -- A plain entry of a window of plain entries removed (a refund): no weights, no
      -- totals to change.
      redis.call('ZREM', key, member)
      return 1
    elseif extra == 0 then
      total = redis.call('ZRANK', key, member) + 1 -- a window of plain entries: its totals
                                                   -- start now, at origin 0
    else
      if old ~= 1 then
        -- Its total and the ones after it, usually among the last few (the requests that
        -- came in while it ran): one read. Else its own, and later a search for those after.
        local last = redis.call('ZRANGE', totals, -RECENT_TOTALS, -1, 'WITHSCORES')
        for j = 1, #last, 2 do
          if last[j] == member then
            total, later = tonumber(last[j + 1]), {}
            for m = j + 2, #last, 2 do
              later[#later + 1] = tonumber(last[m + 1])
              later[#later + 1] = last[m]
            end
            break
          end
        end
        if not total then total = tonumber(redis.call('ZSCORE', totals, member)) end
      end
      if not total and redis.call('ZSCORE', totals, '') then
        total = total_at_rank(i, redis.call('ZRANK', key, member))
      end
    end
    if cost == 0 then
      redis.call('ZREM', key, member)
    end
    -- The weights hold (cost - 1) for every entry whose cost is not 1, and "" their sum:
    -- they exist while that sum is above 0.
    local delta = (cost == 0 and 1 or cost) - old
    local sum = extra + delta
    local weighted = cost ~= 0 and cost ~= 1
    if sum <= 0 then
      redis.call('HDEL', weights, member, '')
    elseif weighted then
      redis.call('HSET', weights, member, cost, '', sum)
    else
      if old ~= 1 then redis.call('HDEL', weights, member) end
      if delta ~= 0 then redis.call('HSET', weights, '', sum) end
    end
    if sum <= 0 then
      redis.call('ZREMRANGEBYRANK', totals, 0, -1)
    elseif total and extra == 0 then
      -- The window's first weighted entry: its totals start here, at origin 0.
      redis.call('ZREMRANGEBYRANK', totals, 0, -1)
      redis.call('ZADD', totals, 0, '', total + new - old, member)
    elseif total then
      -- The entry's own total goes in the ZADD that moves the ones after it.
      local own = nil
      if weighted then
        own = {total + new - old, member}
      elseif old ~= 1 then
        redis.call('ZREM', totals, member)
      end
      if later then
        -- Known already: moved in the same ZADD as its own.
        own = own or {}
        for j = 1, #later, 2 do
          own[#own + 1] = later[j] + new - old
          own[#own + 1] = later[j + 1]
        end
        if #own > 0 then redis.call('ZADD', totals, unpack(own)) end
      else
        shift_totals_after(i, total, new - old, own)
      end
    end
    if weighted and old == 1 then
      -- Weighted here (or created here): they must live as long as the entries they weigh.
      -- An entry weighted already was when they got their TTL (at its add, or here).
      local ttl = redis.call('PTTL', key)
      if ttl > 0 then
        redis.call('PEXPIRE', weights, ttl)
        if total or redis.call('EXISTS', totals) == 1 then redis.call('PEXPIRE', totals, ttl) end
      end
    end
    return 1
  end

  return long
end

-- The log of a call's n windows, and the request's time it is read at (script_now(given,
-- writes), lib/clock.lua): functions over KEYS[i], KEYS[n + i] and KEYS[2n + i].
--
-- A check over plain windows (no weights: the weights' "" field is absent) takes the
-- short way: the window's used cost is counted (ZCOUNT of the entries after
-- now - window_ms), not trimmed first; the trim comes after the entry's ZADD (add), or at
-- the end of a decision that logged nothing (flush). An allowed check runs HGET, ZCOUNT,
-- ZADD, ZREMRANGEBYSCORE and EXPIRE per window. A weighted window goes the long way
-- (zset_weighted, built then).
--
-- `probe`, the OOM probe. Redis refuses a command that may grow memory (ZADD) under OOM
-- only while the script has written nothing yet, and a trim that removed an entry would
-- let every later ZADD through. The probe is such a command that changes nothing (ZADD XX:
-- only existing members; "" is never a member): over maxmemory it fails the whole script
-- with -OOM, and nothing was written. true: it runs first, before the clock is read (the
-- scripts that write before the log does: leases, reconcile). 'lazy' (sliding_window.lua,
-- whose only writes are the log's): it runs only before a write Redis would let through,
-- a weighted window's trim; over plain windows the first write is the entry's own ZADD,
-- which Redis refuses itself. So a full Redis still refuses every check that would log,
-- with nothing written, and answers a refusal (which logs nothing; its trims only free).
local function zset_log(n, given, writes, probe)
  local lazy = probe == 'lazy'
  if probe and not lazy then redis.call('ZADD', KEYS[1], 'XX', 0, '') end
  local now = script_now(given, writes)
  -- owed[i]: the time at or before which plain window i's entries have left it, its trim
  -- being owed (nil for a weighted window, or once trimmed); owed[n + i]: its live entries.
  -- Times go to Redis as text made here once ("%d"): a number argument is formatted by
  -- Redis's "%.17g", which costs the server more.
  -- The tables are made by constructors, sized once: a table grown field by field is
  -- resized at every power of two, which costs the server more than its closures.
  local owed, weighted, now_text = {nil, nil}, nil, nil
  local log = {
    -- Window i's used cost at now (its trim owed, for a plain window).
    trim = function(i, window_ms)
      local extra = redis.call('HGET', KEYS[n + i], '')
      if extra then
        owed[i] = nil
        weighted = weighted or zset_weighted(n, now, not lazy)
        return weighted.trim(i, window_ms, tonumber(extra))
      end
      local bound = now - window_ms
      if bound % 1 == 0 then bound = string.format('%d', bound) end
      local live = redis.call('ZCOUNT', KEYS[i], '(' .. bound, '+inf')
      owed[i], owed[n + i] = bound, live
      return live
    end,

    -- The time of window i's oldest live entry whose leaving frees `need` units, or nil when
    -- none does; after trim(i). In a plain window every entry costs 1: the need-th live one,
    -- after the gone ones still in the set.
    freeing_stamp = function(i, window_ms, need)
      if not owed[i] then return weighted.freeing_stamp(i, window_ms, need) end
      local at = redis.call('ZCARD', KEYS[i]) - owed[n + i] + need - 1
      local score = redis.call('ZRANGE', KEYS[i], at, at, 'WITHSCORES')[2]
      return score and tonumber(score)
    end,

    -- Logs `member` at now in window i with `cost`; the keys live window_ms + 1 s. A plain
    -- window: the ZADD first (under OOM Redis refuses it, nothing written), then its owed
    -- trim; a first weighted entry then starts the weights (zset_weighted's weigh).
    add = function(i, member, cost, window_ms)
      local bound = owed[i]
      if not bound then return weighted.add(i, member, cost, window_ms) end
      owed[i] = nil
      if not now_text then now_text = now % 1 == 0 and string.format('%d', now) or now end
      local key = KEYS[i]
      local seconds = window_ms / 1000 + 1
      local added = redis.call('ZADD', key, now_text, member)
      redis.call('ZREMRANGEBYSCORE', key, '-inf', bound)
      redis.call('EXPIRE', key, seconds)
      if cost ~= 1 then
        weighted = weighted or zset_weighted(n, now, true)
        weighted.weigh(i, member, cost, seconds, 0, nil, owed[n + i] + added)
      end
    end,

    -- The tie of a decision's entries: none here (lib/compact_log.lua needs one), and no
    -- other time than now for them.
    tie = function() return 0 end,

    -- The end of a decision: the trims still owed (the plain windows measured but not
    -- logged in: a refusal's, a replay's) are done, as a trim before the decision would have.
    flush = function()
      for i = 1, n do
        local bound = owed[i]
        if bound then
          redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', bound)
          owed[i] = nil
        end
      end
    end,

    -- When `member` is logged in window i (a replay whose first attempt counted): its time
    -- and tie (always 0 here: members tell entries apart); else nil.
    logged = function(i, member)
      local at = redis.call('ZSCORE', KEYS[i], member)
      if at then return tonumber(at), 0 end
      return nil
    end,
  }

  -- The rest (peek's look, reconcile's set_cost) is zset_weighted's, for the scripts other
  -- than the check, which uses none of it.
  if not lazy then
    weighted = zset_weighted(n, now, true)
    log.look, log.set_cost = weighted.look, weighted.set_cost
    log.peek_freeing_stamp = weighted.peek_freeing_stamp
  end
  return log, now
end

-- The storage as the entry scripts see it: setup.py builds each script that includes
-- "lib/{storage}_log.lua" once with this file and once with lib/compact_log.lua, which
-- defines the same three names. KEYS_PER_WINDOW: the keys of one window in KEYS (its set,
-- weights and totals); open_log(n, given, writes, probe): the log of a call's n windows
-- and the time it is read at; TIE_NAMES_ENTRY: whether a check's reply names its entry by a tie (8th
-- element): no, its member does.
local KEYS_PER_WINDOW, open_log, TIE_NAMES_ENTRY = 3, zset_log, false
