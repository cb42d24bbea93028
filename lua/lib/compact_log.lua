--[[
lib/compact_log.lua - the sliding-window log kept in one Redis string per window (storage
"compact"). Prepended by the build (setup.py) to the scripts that name it; functions only.

Admitted requests are logged in time order, so a window is a sorted sequence of fixed-width
entries: the window's edge, its used cost and the entry whose leaving frees enough are
searches that read one slice of entries (GETRANGE) where the target should be (between two
known entries, in proportion: times and running totals grow about evenly), then bisect it
in Lua; the entries that left are dropped by moving a head offset, and the string is
rewritten (compacted) only when it runs out of room or is mostly dead. The header keeps
what an allowed call needs (the first and last entries' times, the running total, the
room), so one is a read of the header, a write of the entry, a write of the header (with
the replay slot) and an EXPIRE; a refusal that needs the oldest entry finds its time there.

Server time is mostly per redis.call and per object made (a closure, a table, a string):
the functions of the rare paths and of the searches are made only when a call needs them.

The value, layout version 2 (integers big-endian, unsigned), in one of two forms.
The full form (byte 0 = 2):
  0   1 B  version (2); another version is refused, never misread (1 is read, below)
  1   1 B  S: the width of an entry's time (4, 5 or 6 bytes, from the window's length)
  2   1 B  C: the width of an entry's running total (0: every entry costs 1; else 6 or 7)
  3   1 B  R: slots of the replay table (0 to REPLAY_SLOTS; only a decision's longest
           window has any)
  4   6 B  base: an entry's time is base + its stored time, unix ms
  10  4 B  head: byte offset of the first entry (the ones before it have left)
  14  4 B  tail: byte offset past the last entry (room follows)
  18  4 B  size: the string's length (the room ends there)
  22  6 B  first: the first entry's time, unix ms (when there is one)
  28  6 B  last: the last entry's time, unix ms (when there is one)
  34  2 B  next tie: a tie above every tie of the entries at time `last` (0 when one there
           has tie 65,535: that millisecond has none left)
  36  1 B  next slot of the replay table
  37  (C > 0 only) 7 B origin: the running total before the first entry; 7 B total: the
           running total of the last entry (origin when empty)
  37 or 51  16R  the replay table: R slots of {request id: the first 8 bytes of its UUID4,
           its time (6 B, unix ms), its tie (2 B)}, recent admissions; the next slot is the
           oldest, or, while R < REPLAY_SLOTS, the slots are oldest first and the table
           grows (to REPLAY_SLOTS at once in this form)
  then     entries, each {time - base (S B), tie (2 B), running total (C B)}, sorted by
           (time, tie); the running total includes the entry's own cost; then room
The short form (byte 0 = 3), a value under READ bytes kept exactly its size (no room, no
entry that left), so that a window of few entries costs little: {version, S, C, R (1 B
each), base (6 B), next tie (2 B), next slot (1 B)} (13 B), origin and total (7 B each)
when C > 0, the replay table, the entries. head is where the table ends, tail and size the
value's length; first and last are read from the first and last entries. Its header read
(GETRANGE 0 .. READ - 1) takes it whole, so an admission writes it again whole, with one
SET that sets its TTL too; its replay table keeps the admissions whose entries are still in
the window (up to REPLAY_SLOTS, oldest first; one slot for one admission). A value that
grows to READ bytes takes the full form (with room); one that shrinks under it the short
form again at its next admission.
Layout 1 (byte 0 = 1, the previous release's) is read as it is: the full form's fields in
the order version, S, C, R, base, head, tail, size, origin (7 B), total (7 B), first, last,
next tie, next slot (51 B in every window), then a table of 8 slots; any write rewrites it
in layout 2 (its entries are the same bytes).
An entry is identified by (time, tie): one decision logs one entry in each of its windows,
at one time and with one tie, above every tie its windows hold at that time, so no two
entries of a window share both, and the entries of one millisecond are in the order of
their ties. The ties of a millisecond go on from the window's next tie while that is below
TIE_HALF, else start again at 0 (a tie never wraps within a millisecond). A millisecond
that has no tie left in one of the windows (its last entry there has tie 65,535: tens of
thousands of admissions in one millisecond, which only a client clock that stands still
can ask) logs the decision's entries at the next millisecond that has one: they leave
their windows 1 ms later than the request's time would have them leave (the only answers
that then differ from the sorted sets'), and the reply names that time.
--]]

local COMPACT_VERSION = 2
local HEADER = '>BBBBI6I4I4I4I6I6I2B' -- layout 2, every window; then '>I7I7' when C > 0
local HEADER_PLAIN, HEADER_WEIGHTED = 37, 51
local HEADER_V1 = '>BBBBI6I4I4I4I7I7I6I6I2B' -- layout 1 (read, then rewritten as 2)
local HEADER_SIZE = 51 -- layout 1's, and layout 2's when C > 0
local READ = 256 -- the bytes a header read takes: a shorter value is read whole
local SHORT_VERSION = 3 -- layout 2's short form: a value kept exactly its size, under READ
local SHORT = '>BBBBI6I2B' -- its header; then '>I7I7' when C > 0
local SHORT_PLAIN, SHORT_WEIGHTED = 13, 27
local REPLAY_SLOTS = 8
local SLOT_SIZE = 16
local TIE_LIMIT = 65536
local TIE_HALF = 32768 -- the ties of a new millisecond go on from the next tie below this
local BATCH = 1000 -- entries decoded at once (Lua's unpack takes a few thousand values)
local SLICE = 32 -- entries a search reads at once (one GETRANGE), then searches in Lua

-- The width of an entry's stored time for a window of window_ms: room for four windows
-- from the base (4 bytes up to 12 days, 5 up to 8 years, 6 beyond).
local function stamp_width(window_ms)
  if window_ms * 4 < 2 ^ 32 then return 4 end
  if window_ms * 4 < 2 ^ 40 then return 5 end
  return 6
end

-- Room for `count` entries and those to come: an eighth more, at least 4.
local function capacity_for(count)
  return count + math.max(4, math.ceil(count / 8))
end

-- The struct format of one entry whose time is S bytes wide and running total C (literals:
-- no string is built per call).
local function entry_format(S, C)
  if S == 4 then
    if C == 0 then return '>I4I2' elseif C == 6 then return '>I4I2I6' end
    return '>I4I2I7'
  elseif S == 5 then
    if C == 0 then return '>I5I2' elseif C == 6 then return '>I5I2I6' end
    return '>I5I2I7'
  end
  if C == 0 then return '>I6I2' elseif C == 6 then return '>I6I2I6' end
  return '>I6I2I7'
end

-- The header's size in layout 2: the running totals' fields only in a weighted window.
local function header_size(C)
  if C == 0 then return HEADER_PLAIN end
  return HEADER_WEIGHTED
end

-- The parsed header of the string at `key`, or {exists = false}; its first READ bytes (the
-- replay table among them; the whole value when it is shorter: `whole`) are kept: `read`,
-- when given, is them, read by this call before any write (admit_plain), else they are read. Layout 1
-- is read as well (its `version` kept: a write rewrites it as layout 2); another version is
-- an error reply (never misread).
local function compact_header(key, read)
  local bytes = read or redis.call('GETRANGE', key, 0, READ - 1)
  if bytes == '' then return {key = key, exists = false, gone = 0, whole = true} end
  local version = string.byte(bytes, 1)
  local _, S, C, R, base, head, tail, size, origin, total, first, last, next_tie, next_slot
  local size_of_header = HEADER_SIZE
  if version == COMPACT_VERSION and #bytes >= HEADER_PLAIN then
    _, S, C, R, base, head, tail, size, first, last, next_tie, next_slot =
      struct.unpack(HEADER, bytes)
    origin, total, size_of_header = 0, 0, header_size(C)
    if C > 0 and #bytes >= HEADER_WEIGHTED then
      origin, total = struct.unpack('>I7I7', bytes, HEADER_PLAIN + 1)
    end
  elseif version == SHORT_VERSION and #bytes >= SHORT_PLAIN and #bytes < READ then
    -- The short form: the value ends where its entries do; the first and last entries'
    -- times are read from them.
    _, S, C, R, base, next_tie, next_slot = struct.unpack(SHORT, bytes)
    origin, total, size_of_header = 0, 0, SHORT_PLAIN
    if C > 0 then
      size_of_header = SHORT_WEIGHTED
      if #bytes >= SHORT_WEIGHTED then
        origin, total = struct.unpack('>I7I7', bytes, SHORT_PLAIN + 1)
      end
    end
    head = size_of_header + SLOT_SIZE * R
    tail, size, first, last = #bytes, #bytes, 0, 0
    -- No offsets to cross-check: a value cut short (or of unknown widths) is refused here.
    if tail < head or S < 4 or S > 6 or (C ~= 0 and C ~= 6 and C ~= 7) or
        (tail - head) % (S + 2 + C) ~= 0 then
      S = nil
    elseif tail > head then
      local at = string.sub(entry_format(S, 0), 1, 3) -- the stored time's format
      first = base + struct.unpack(at, bytes, head + 1)
      last = base + struct.unpack(at, bytes, tail - (S + 2 + C) + 1)
    end
  elseif version == 1 and #bytes >= HEADER_SIZE then
    _, S, C, R, base, head, tail, size, origin, total, first, last, next_tie, next_slot =
      struct.unpack(HEADER_V1, bytes)
  end
  if not S or #bytes < size_of_header then
    error({err = 'genai-ratelimit: ' .. key .. ' holds an unknown compact layout (version ' ..
      tostring(version) .. ', ' .. #bytes .. ' header bytes)'})
  end
  local E = S + 2 + C
  -- One constructor: the table is sized once, not grown field by field.
  return {key = key, exists = true, version = version, S = S, C = C, R = R, base = base,
    head = head, tail = tail, size = size, origin = origin, total = total, first = first,
    last = last, next_tie = next_tie, next_slot = next_slot, E = E,
    data = size_of_header + SLOT_SIZE * R, count = (tail - head) / E,
    fmt = entry_format(S, C), bytes = bytes, whole = #bytes < READ, gone = 0,
    dead_total = origin, oldest = first, fresh = true}
    -- dirty, table_dirty, table: nil (false); fresh: nothing written to the value since
    -- `bytes` were read (value_range may serve from them)
end

-- Bytes from .. to (offsets, inclusive) of window st's value: cut from the bytes its header
-- read took when they hold them and nothing was written since (a short value was read
-- whole), else read (GETRANGE).
-- The last range read is kept too (a search's slice holds the entries a reconcile then
-- moves).
local function value_range(st, from, to)
  local bytes = st.bytes
  if st.fresh then
    if bytes and (to < #bytes or st.whole) then return string.sub(bytes, from + 1, to + 1) end
    local kept, at = st.kept, st.kept_at
    if kept and from >= at and to < at + #kept then
      return string.sub(kept, from - at + 1, to - at + 1)
    end
  end
  bytes = redis.call('GETRANGE', st.key, from, to)
  st.kept, st.kept_at = bytes, from
  return bytes
end

-- The replay table of a parsed header (cut from its first bytes when first needed).
local function replay_table(st)
  if not st.table then st.table = string.sub(st.bytes, st.data - SLOT_SIZE * st.R + 1, st.data) end
  return st.table
end

-- The number of entries the string at `key` holds (reset's count), 0 when it is absent,
-- nil when it cannot be read: another layout version, a header that does not add up (a
-- damaged value), a key of another type.
local function compact_entries(key)
  local ok, st = pcall(compact_header, key)
  if not ok then return nil end
  if not st.exists then return 0 end
  local count = st.count
  if st.S < 4 or st.S > 6 or (st.C ~= 0 and st.C ~= 6 and st.C ~= 7) or st.head < st.data or
      st.tail > st.size or count < 0 or count ~= math.floor(count) then
    return nil
  end
  return count
end

-- A request id's 8 bytes (the first 16 hex digits of its UUID4 text), as two numbers.
local function request_id(member)
  return tonumber(string.sub(member, 1, 8), 16),
    tonumber(string.sub(member, 10, 13), 16) * 65536 + tonumber(string.sub(member, 15, 18), 16)
end

-- The check's common call made at once (sliding_window.lua: one window, no shared scope,
-- cost 1, no replay marker): an admission into a window of plain entries that needs no trim
-- (its first entry is still in the window), no search (its last entry is not after now), no
-- new layout and no copy (the full form has room; the short form stays under READ bytes).
-- It writes exactly what the general path (compact_log's trim, tie and add) writes, from
-- the header read's values, without the log's tables and closures. Returns the reply
-- (lib/decide.lua's, with the tie), or nil and the bytes read (nil: none), having written
-- nothing, when the call needs the general path (a refusal among them), which reads them
-- from there.
local function admit_plain(now)
  -- No optional argument after the window's (a replay marker, or anything a later script
  -- version adds there): the general path.
  if #KEYS ~= 1 or #ARGV ~= 5 or tonumber(ARGV[5]) ~= 1 then return nil end
  local key = KEYS[1]
  local bytes = redis.call('GETRANGE', key, 0, READ - 1)
  local window_ms, limit = tonumber(ARGV[3]), tonumber(ARGV[4])
  local edge = now - window_ms
  local version = string.byte(bytes, 1)
  if version == COMPACT_VERSION then
    -- (A full form shorter than READ, read whole, is written again whole: the general path.)
    if #bytes < READ then return nil, bytes end
    -- The fields a refusal needs first (a refusal leaves at the first check), then the rest.
    local S, C, R = string.byte(bytes, 2, 4)
    local head, tail = struct.unpack('>I4I4', bytes, 11)
    local E = S + 2
    if C ~= 0 or R ~= REPLAY_SLOTS or tail <= head or (tail - head) / E + 1 > limit then
      return nil, bytes
    end
    local base = struct.unpack('>I6', bytes, 5)
    local size, first, last, next_tie, next_slot = struct.unpack('>I4I6I6I2B', bytes, 19)
    if first <= edge or last > now or tail + E > size or now - base >= 256 ^ S then
      return nil, bytes
    end
    local tie = next_tie
    if now == last then
      if tie == 0 then return nil, bytes end -- no tie left in this millisecond
    elseif tie >= TIE_HALF then
      tie = 0
    end
    local id_high, id_low = request_id(ARGV[1])
    redis.call('SETRANGE', key, tail, struct.pack(entry_format(S, 0), now - base, tie))
    -- The header, then the replay table up to and including this admission's slot.
    redis.call('SETRANGE', key, 0, struct.pack(HEADER, COMPACT_VERSION, S, 0, R, base, head,
        tail + E, size, first, now, (tie + 1) % TIE_LIMIT, (next_slot + 1) % R) ..
      string.sub(bytes, HEADER_PLAIN + 1, HEADER_PLAIN + next_slot * SLOT_SIZE) ..
      struct.pack('>I4I4I6I2', id_high, id_low, now, tie))
    redis.call('EXPIRE', key, window_ms / 1000 + 1)
    local left = limit - (tail - head) / E - 1
    return {1, left, 0, 1, now, {left}, 0, tie}
  end
  local S, R, base, next_tie, next_slot, head, entries, tie
  if version == SHORT_VERSION then
    if #bytes < SHORT_PLAIN or #bytes >= READ then return nil, bytes end
    local C
    S, C, R = string.byte(bytes, 2, 4)
    head = SHORT_PLAIN + SLOT_SIZE * R
    local E = S + 2
    if C ~= 0 or S < 4 or S > 6 or #bytes <= head or (#bytes - head) % E ~= 0 or
        (#bytes - head) / E + 1 > limit then
      return nil, bytes
    end
    base, next_tie, next_slot = struct.unpack('>I6I2B', bytes, 5)
    if now - base >= 256 ^ S then return nil, bytes end
    local at = string.sub(entry_format(S, 0), 1, 3) -- the stored time's format
    local last = base + struct.unpack(at, bytes, #bytes - E + 1)
    if base + struct.unpack(at, bytes, head + 1) <= edge or last > now then
      return nil, bytes
    end
    tie = next_tie
    if now == last then
      if tie == 0 then return nil, bytes end
    elseif tie >= TIE_HALF then
      tie = 0
    end
    entries = string.sub(bytes, head + 1)
  elseif bytes == '' then
    -- A new window: its layout from this entry (one replay slot).
    S, R, base, next_slot, head, entries, tie = stamp_width(window_ms), 0, edge, 0,
      SHORT_PLAIN, '', 0
    if limit < 1 then return nil, bytes end
  else
    return nil, bytes
  end
  local id_high, id_low = request_id(ARGV[1])
  -- The short form, written again whole with its TTL: the replay table keeps the admissions
  -- still in the window (a full table whose oldest one is: it makes room), then this one.
  local slot = struct.pack('>I4I4I6I2', id_high, id_low, now, tie)
  local slots, s = string.sub(bytes, SHORT_PLAIN + 1, head), next_slot * SLOT_SIZE
  if R == REPLAY_SLOTS and struct.unpack('>I6', slots, s + 9) > edge then
    slots = string.sub(slots, 1, s) .. slot .. string.sub(slots, s + SLOT_SIZE + 1)
    next_slot = (next_slot + 1) % REPLAY_SLOTS
  else
    local kept = {}
    for j = 0, R - 1 do
      local o = (next_slot + j) % R * SLOT_SIZE
      if struct.unpack('>I6', slots, o + 9) > edge then
        kept[#kept + 1] = string.sub(slots, o + 1, o + SLOT_SIZE)
      end
    end
    kept[#kept + 1] = slot
    local from = math.max(1, #kept - REPLAY_SLOTS + 1)
    slots, R, next_slot = table.concat(kept, '', from), #kept - from + 1, 0
  end
  entries = entries .. struct.pack(entry_format(S, 0), now - base, tie)
  if SHORT_PLAIN + #slots + #entries >= READ then return nil, bytes end -- the full form
  redis.call('SET', key, struct.pack(SHORT, SHORT_VERSION, S, 0, R, base, (tie + 1) % TIE_LIMIT,
    next_slot) .. slots .. entries, 'PX', window_ms + 1000)
  local left = limit - #entries / (S + 2)
  return {1, left, 0, 1, now, {left}, 0, tie}
end

-- The compact log of a call's n windows (KEYS[1..n]), and the request's time it is read
-- at (script_now(given, writes), lib/clock.lua). `probe`: the OOM probe runs first, before the
-- clock is read: SETRANGE may grow memory, so a Redis over its maxmemory refuses it while
-- the script has written nothing; with an empty value it changes nothing (and creates no
-- key). Later writes are then let through, as the script can no longer stop halfway.
-- The probe is needed only by a script that may write another key before its windows (the
-- leases of reserve_in_flight.lua: #KEYS > n): a compact window's writes (SET, SETRANGE)
-- are all refused over maxmemory while the script has written nothing, so the first one is
-- its own probe.
local function compact_log(n, given, writes, probe)
  if probe and #KEYS > n then redis.call('SETRANGE', KEYS[1], 0, '') end
  local now = script_now(given, writes)
  -- The check's common call: decided and logged at once (else the general path, which
  -- takes KEYS[1]'s header bytes from there when it read them).
  local first_read = nil
  if probe == 'lazy' and n == 1 then
    local decided
    decided, first_read = admit_plain(now)
    if decided then return nil, now, decided end
  end
  -- Its functions' slots made at once (the table is sized once, not grown field by field).
  -- log.at: the time the decision's entries are logged at (log.tie), false before: now, or
  -- a later millisecond (see the header); the reply names it.
  local log = {trim = false, look = false, freeing_stamp = false, peek_freeing_stamp = false,
    tie = false, logged = false, add = false, flush = false, set_cost = false, at = false}
  local state = {} -- per window: its header, as loaded and changed, and the last measure

  local function header_bytes(st)
    local bytes = struct.pack(HEADER, COMPACT_VERSION, st.S, st.C, st.R, st.base, st.head,
      st.tail, st.size, st.first, st.last, st.next_tie, st.next_slot)
    if st.C == 0 then return bytes end
    return bytes .. struct.pack('>I7I7', st.origin, st.total)
  end

  -- A short value's header (layout 2's short form).
  local function short_header(st)
    local bytes = struct.pack(SHORT, SHORT_VERSION, st.S, st.C, st.R, st.base, st.next_tie,
      st.next_slot)
    if st.C == 0 then return bytes end
    return bytes .. struct.pack('>I7I7', st.origin, st.total)
  end

  local rare_ops

  -- Writes the header, and the replay table when it changed (it follows the header); a
  -- value of layout 1 is rewritten whole in the full form, one in the short form again in
  -- the short form (exactly its size) while it stays under READ bytes.
  local function save_header(st)
    if st.version ~= COMPACT_VERSION then
      rare_ops().compact(st, 0, st.version == SHORT_VERSION)
      return
    end
    local bytes = header_bytes(st)
    if st.table_dirty then bytes = bytes .. st.table end
    redis.call('SETRANGE', st.key, 0, bytes)
    st.dirty, st.table_dirty, st.fresh = false, false, false
  end

  -- The searches over a window's entries (a trim that drops some, a refusal's freeing
  -- entry, a reconcile): their functions are made on first use, as an admission into a
  -- window none left needs none.
  local search
  local function search_ops()
    if search then return search end
    -- The raw bytes of entries k .. k + count - 1.
    local function slice(st, k, count)
      local from = st.head + k * st.E
      return value_range(st, from, from + count * st.E - 1)
    end

    -- Entry j (0 = the first) of raw `bytes`: {stored time, tie, running total or nil}.
    local function decode(st, bytes, j)
      local at, tie, total = struct.unpack(st.fmt, bytes, j * st.E + 1)
      if st.C == 0 then total = nil end
      return at, tie, total
    end

    -- Entry k's {stored time, tie, running total or nil}: from `bytes` (entries from `from`
    -- on, a search's slice) when they hold it, else read.
    local function entry(st, k, bytes, from)
      if bytes and k >= from and (k - from + 1) * st.E <= #bytes then
        return decode(st, bytes, k - from)
      end
      return decode(st, slice(st, k, 1), 0)
    end

    -- The first k in [lo, hi) whose entry's field f (1: stored time, 3: running total) is
    -- at least `target`, or hi; the field grows along the entries. Entries lk and hk (any
    -- k, or nil) have the known values lv and hv: the first slice read is where the target
    -- falls between them (an interpolation), the next ones too while that halves the range,
    -- else the middle; `near_lo` (an answer expected near lo): the first slice read starts
    -- at lo. A range of 2 * SLICE entries or less is read at once, and searched in Lua.
    -- Returns k and the last slice read and where it starts (nil when none holds k).
    local function first_at_least(st, lo, hi, f, target, lk, lv, hk, hv, near_lo)
      local guess = lk and hk and hv > lv
      while hi > lo do
        local from, count = lo, hi - lo
        if near_lo then
          count, near_lo = math.min(count, SLICE), false
        elseif count > 2 * SLICE then
          local at = math.floor((lo + hi) / 2)
          if guess then
            at = lk + math.floor((target - lv) * (hk - lk) / (hv - lv))
          end
          from, count = math.max(lo, math.min(at - SLICE / 2, hi - SLICE)), SLICE
        end
        local bytes = slice(st, from, count)
        local width_before = hi - lo
        if select(f, decode(st, bytes, 0)) >= target then
          if from == lo then return lo, bytes, from end
          hi, hk, hv = from, from, select(f, decode(st, bytes, 0))
        else
          local last = select(f, decode(st, bytes, count - 1))
          if last < target then
            if from + count == hi then return hi end
            lo, lk, lv = from + count, from + count - 1, last
          else
            -- Entry 0 of the slice is below the target, its last one at or above it.
            local a, b = 1, count - 1
            while a < b do
              local middle = math.floor((a + b) / 2)
              if select(f, decode(st, bytes, middle)) >= target then
                b = middle
              else
                a = middle + 1
              end
            end
            return from + a, bytes, from
          end
        end
        -- Interpolate again only after a step that halved the range (else the middle).
        guess = lk ~= nil and hk ~= nil and hv > lv and (hi - lo) * 2 <= width_before
      end
      return hi
    end

    -- Entry k's running total; k = -1: the origin; k = count - 1: the header's total (a
    -- search's slice, when given, is read first).
    local function total_at(st, k, bytes, from)
      if k < 0 then return st.origin end
      if k == st.count - 1 then return st.total end
      local _, _, total = entry(st, k, bytes, from)
      return total
    end

    -- The first entry of window st still in a window of window_ms at now (at least 1: the
    -- caller knows the first one left), with the search's slice. The entries that left
    -- since the last call are usually few: the first slice read is the window's start
    -- (arrivals in bursts would mislead an interpolation).
    local function first_live(st, window_ms)
      local edge = math.floor(now - window_ms - st.base) + 1 -- the least stored time still in
      return first_at_least(st, 1, st.count, 1, edge, 0, st.first - st.base, st.count - 1,
        st.last - st.base, true)
    end
    search = {entry = entry, first_at_least = first_at_least, total_at = total_at,
      first_live = first_live}
    return search
  end

  -- The rare paths (a new window, a copy to a fresh string, a new layout, entries moved):
  -- their functions are made on first use. A function made per call costs even when
  -- unused, and most calls take none of these.
  local rare
  function rare_ops()
    if rare then return rare end
    -- Entries k .. k + count - 1 (0 = the first after head): their values, flat.
    local function read(st, k, count)
      local from = st.head + k * st.E
      local bytes = value_range(st, from, from + count * st.E - 1)
      return {struct.unpack('>' .. string.rep(string.sub(st.fmt, 2), count), bytes)}
    end

    -- The values per entry in read's answer.
    local function width(st) return st.C > 0 and 3 or 2 end

    -- Entries from .. from + count - 1, packed again with `delta` added to their running
    -- totals (in batches).
    local function repack(st, from, count, delta)
      local parts, w, one = {}, width(st), string.sub(st.fmt, 2)
      for part = from, from + count - 1, BATCH do
        local size = math.min(BATCH, from + count - part)
        local v = read(st, part, size)
        table.remove(v) -- unpack's next position
        if st.C > 0 then
          for j = 3, #v, w do v[j] = v[j] + delta end
        end
        parts[#parts + 1] = struct.pack('>' .. string.rep(one, size), unpack(v))
      end
      return table.concat(parts)
    end

    -- Rewrites the whole string (SET, keeping its TTL): the header, the replay table, the
    -- entries `entries` (raw, in st's layout) and room for `room` more; with no room and
    -- under READ bytes, in the short form.
    local function rewrite(st, entries, room)
      local slots = replay_table(st) -- cut where the value's header has it, before it moves
      st.E = st.S + 2 + st.C
      st.fmt = entry_format(st.S, st.C)
      local short = st.C > 0 and SHORT_WEIGHTED or SHORT_PLAIN
      st.version = SHORT_VERSION
      if room > 0 or short + #slots + #entries >= READ then
        short, st.version = header_size(st.C), COMPACT_VERSION
      end
      st.data = short + SLOT_SIZE * st.R
      st.head = st.data
      st.tail = st.data + #entries
      st.count = #entries / st.E
      st.size = st.tail + room * st.E
      local header
      if st.version == SHORT_VERSION then header = short_header(st) else header = header_bytes(st) end
      redis.call('SET', st.key, header .. slots .. entries .. string.rep('\0', room * st.E),
        'KEEPTTL')
      st.fresh = false
      st.exists, st.dirty, st.table_dirty = true, false, false
      st.whole = false -- st.bytes is stale
    end

    -- Copies the entries to a fresh string with room for capacity_for(count + extra) (none
    -- when `exact`): drops the ones that left and what was room, as memory copies.
    local function compact(st, extra, exact)
      local entries = ''
      if st.count > 0 then entries = value_range(st, st.head, st.tail - 1) end
      local room = 0
      if not exact then room = capacity_for(st.count + extra) - st.count end
      rewrite(st, entries, room)
    end

    -- Rewrites every entry in a new layout (O(entries) in Lua: rare): the stored times
    -- `S` bytes wide against `base`, the running totals `C` bytes wide with the origin moved
    -- to 0 (C > 0; from a window of cost-1 entries, their totals are 1, 2, ...), the replay
    -- table with `slots` slots. `extra`: room to keep for entries about to come.
    local function relayout(st, base, C, slots, extra, S)
      S = S or st.S
      local old_table = replay_table(st)
      if slots > st.R then st.table = old_table .. string.rep('\0', SLOT_SIZE * (slots - st.R)) end
      local shift, out = st.base - base, {}
      local new_one = string.sub(entry_format(S, C), 2)
      local w = width(st)
      for from = 0, st.count - 1, BATCH do
        local count = math.min(BATCH, st.count - from)
        local v, packed = read(st, from, count), {}
        for j = 0, count - 1 do
          packed[#packed + 1] = v[j * w + 1] + shift
          packed[#packed + 1] = v[j * w + 2]
          if C > 0 then
            packed[#packed + 1] = st.C > 0 and v[j * w + 3] - st.origin or from + j + 1
          end
        end
        out[#out + 1] = struct.pack('>' .. string.rep(new_one, count), unpack(packed))
      end
      st.total = C == 0 and 0 or st.C > 0 and st.total - st.origin or st.count
      st.base, st.S, st.C, st.R, st.origin = base, S, C, slots, 0
      rewrite(st, table.concat(out), capacity_for(st.count + extra) - st.count)
    end
    rare = {read = read, repack = repack, rewrite = rewrite, compact = compact,
      relayout = relayout}
    return rare
  end

  -- Window i's entries that left by now dropped (the header, written by flush or add; the
  -- string is compacted when most of it is dead). Returns its used cost.
  function log.trim(i, window_ms)
    local st = compact_header(KEYS[i], i == 1 and first_read or nil)
    first_read = nil
    state[i] = st
    if not st.exists or st.count == 0 then return 0 end
    if st.first <= now - window_ms then
      local k, bytes, from = search_ops().first_live(st, window_ms)
      st.origin = 0
      if st.C > 0 then st.origin = search_ops().total_at(st, k - 1, bytes, from) end
      if k == st.count then
        st.head, st.tail, st.count = st.data, st.data, 0
      else
        st.first = st.base + search_ops().entry(st, k, bytes, from)
        st.head, st.count = st.head + k * st.E, st.count - k
      end
      st.dirty = true
      -- Mostly dead or room: a copy of what is left, with room for an eighth more.
      if st.size - st.data > 2 * st.E * capacity_for(st.count) + 64 then
        rare_ops().compact(st, 0)
      end
    end
    st.dead_total, st.oldest = st.origin, st.first
    if st.C == 0 then return st.count end
    return st.total - st.origin
  end

  -- Window i as trim would leave it, without writing: its used cost and its oldest entry's
  -- time (nil when empty).
  function log.look(i, window_ms)
    local st = compact_header(KEYS[i])
    state[i] = st
    if not st.exists or st.count == 0 then return 0, nil end
    st.oldest = st.first
    if st.first <= now - window_ms then
      local k, bytes, from = search_ops().first_live(st, window_ms)
      st.gone = k
      if k == st.count then return 0, nil end
      st.dead_total = search_ops().total_at(st, k - 1, bytes, from)
      st.oldest = st.base + search_ops().entry(st, k, bytes, from)
    end
    if st.C == 0 then return st.count - st.gone, st.oldest end
    return st.total - st.dead_total, st.oldest
  end

  -- The time of window i's oldest entry (after the ones gone) whose leaving frees `need`
  -- units, or nil when none does: the need-th entry, or a search on the running totals.
  function log.freeing_stamp(i, _, need)
    local st = state[i]
    if not st.exists then return nil end
    local k, bytes, from
    if st.C == 0 then
      k = st.gone + need - 1
    else
      k, bytes, from = search_ops().first_at_least(st, st.gone, st.count, 3,
        st.dead_total + need, st.gone - 1, st.dead_total, st.count - 1, st.total)
    end
    if k >= st.count then return nil end
    if k == st.gone then return st.oldest end
    if k == st.count - 1 then return st.last end
    return st.base + search_ops().entry(st, k, bytes, from)
  end

  -- The tie a decision over windows 1..n (measured) gives its entries: above every tie
  -- they hold at its time, and that time (log.at): now, or the next millisecond with a tie
  -- left in every window.
  function log.tie()
    local at = now
    while true do
      local tie = 0
      for i = 1, n do
        -- The least tie window i can give: above the ties of its entries at `at` (TIE_LIMIT:
        -- none is left), and not below its next tie when that goes on (below TIE_HALF).
        local st, free = state[i], 0
        if st.exists and st.next_tie < TIE_HALF then free = st.next_tie end
        local held = st.exists and st.count > 0 -- else no entry at `at`
        if held and at == st.last then
          free = st.next_tie == 0 and TIE_LIMIT or st.next_tie
        elseif held and at < st.last and at >= st.base then
          -- Another clock behind: the entry before its place, when it is of the same
          -- millisecond, has the highest tie there.
          local found, stored = search_ops(), at - st.base
          local k, bytes, from = found.first_at_least(st, 0, st.count, 1, stored + 1, 0,
            st.first - st.base, st.count - 1, st.last - st.base)
          local t, e = nil, nil
          if k > 0 then t, e = found.entry(st, k - 1, bytes, from) end
          if t == stored then free = math.max(e + 1, free) end
        end
        if free > tie then tie = free end
      end
      if tie < TIE_LIMIT then
        log.at = at
        return tie, at
      end
      at = at + 1
    end
  end

  -- When `member` is in window i's replay table (its first attempt was allowed): the
  -- time and tie it was logged with; else nil.
  function log.logged(i, member)
    local st = compact_header(KEYS[i])
    if not st.exists or st.R == 0 then return nil end
    local id = struct.pack('>I4I4', request_id(member))
    local slots = replay_table(st)
    for s = 0, st.R - 1 do
      if string.sub(slots, s * SLOT_SIZE + 1, s * SLOT_SIZE + 8) == id then
        local at, tie = struct.unpack('>I6I2', slots, s * SLOT_SIZE + 9)
        return at, tie
      end
    end
    return nil
  end

  -- The replay table of window st rewritten with a new admission's `slot`: the slots of the
  -- admissions still in the window (logged after `edge`), oldest first, then the new one;
  -- the REPLAY_SLOTS latest. Returns it and its number of slots (the next slot is then 0:
  -- the oldest, or a slot to add while there are fewer than REPLAY_SLOTS).
  local function fresh_table(st, edge, slot)
    local kept, R = {}, st.exists and st.R or 0
    local slots = R > 0 and replay_table(st) or ''
    for j = 0, R - 1 do
      local s = (st.next_slot + j) % R * SLOT_SIZE
      if struct.unpack('>I6', slots, s + 9) > edge then
        kept[#kept + 1] = string.sub(slots, s + 1, s + SLOT_SIZE)
      end
    end
    kept[#kept + 1] = slot
    local from = math.max(1, #kept - REPLAY_SLOTS + 1)
    return table.concat(kept, '', from), #kept - from + 1
  end

  -- Logs an entry at now with `cost` and `tie` in window i (after its trim), recording
  -- `member` in its replay table when it is the decision's longest window (i = n). The key
  -- lives window_ms + 1 s.
  function log.add(i, member, cost, window_ms, tie)
    local now = log.at or now -- the entry's time (log.tie)
    local st = state[i]
    local slot = nil
    if i == n then
      local id_high, id_low = request_id(member)
      slot = struct.pack('>I4I4I6I2', id_high, id_low, now, tie)
    end
    if st.whole then
      -- A short value (its header read took it whole; or none yet) that the entry is
      -- appended to: written again whole in layout 2, exactly its size (no room), the
      -- entries that left dropped, the replay table holding only the admissions still in
      -- the window: one SET, its TTL with it.
      local fresh = not st.exists or st.count == 0
      local at = fresh or now - st.base
      if fresh or (st.last <= now and at < 256 ^ st.S and (cost == 1 or st.C > 0) and
          (st.C == 0 or st.total + cost < 256 ^ st.C)) then
        local slots, R, next_slot = '', st.R or 0, st.next_slot or 0
        local s = next_slot * SLOT_SIZE
        if slot and R == REPLAY_SLOTS and
            struct.unpack('>I6', replay_table(st), s + 9) > now - window_ms then
          -- A full table whose oldest admission is still in the window: it makes room.
          local old = replay_table(st)
          slots = string.sub(old, 1, s) .. slot .. string.sub(old, s + SLOT_SIZE + 1)
          next_slot = (next_slot + 1) % REPLAY_SLOTS
        elseif slot then
          slots, R = fresh_table(st, now - window_ms, slot)
          next_slot = 0
        elseif R > 0 then
          slots = replay_table(st)
        end
        local entries = ''
        if fresh then
          -- A new window, or an empty one: its layout from this entry.
          st.S, st.C, st.base, st.origin, st.total = stamp_width(window_ms),
            cost ~= 1 and 6 or 0, now - window_ms, 0, 0
          st.E, st.fmt, st.count, st.first = st.S + 2 + st.C, entry_format(st.S, st.C), 0, now
          at = now - st.base
        else
          entries = string.sub(st.bytes, st.head + 1, st.tail)
        end
        local total = nil
        if st.C > 0 then
          total = st.total + cost
          st.total = total
        end
        entries = entries .. struct.pack(st.fmt, at, tie, total)
        st.last, st.next_tie, st.count = now, (tie + 1) % TIE_LIMIT, st.count + 1
        st.R, st.next_slot = R, next_slot
        -- The short form while the value stays under READ bytes (read whole), else the full.
        local short = SHORT_PLAIN
        if st.C > 0 then short = SHORT_WEIGHTED end
        st.version = SHORT_VERSION
        if short + #slots + #entries >= READ then
          short, st.version = header_size(st.C), COMPACT_VERSION
        end
        st.data = short + SLOT_SIZE * R
        st.head, st.tail = st.data, st.data + #entries
        st.size = st.tail
        local header
        if st.version == SHORT_VERSION then header = short_header(st) else header = header_bytes(st) end
        redis.call('SET', st.key, header .. slots .. entries, 'PX', window_ms + 1000)
        st.fresh = false
        st.exists, st.whole, st.table, st.bytes = true, false, false, nil
        st.dirty, st.table_dirty = false, false
        return
      end
    end
    local slots = slot and REPLAY_SLOTS or 0
    if slots < st.R then slots = st.R end
    local at = now - st.base
    local base = st.base
    if at < 0 or at >= 256 ^ st.S then
      -- Out of the stored times' range (a clock far behind, or years of a busy window):
      -- the base moves to the oldest entry, less a window.
      local oldest = st.count > 0 and st.first or now
      base = math.min(oldest, now) - window_ms
    end
    -- Clocks years apart (or a window that never empties for years) need wider times.
    local S = st.S
    local newest = st.count > 0 and math.max(st.last, now) or now
    while newest - base >= 256 ^ S and S < 6 do S = S + 1 end
    -- Running totals from the first entry of another cost on; none again once a window
    -- that held such entries is empty and this entry costs 1.
    local C = st.C
    if cost ~= 1 and C == 0 then C = 6 end
    if cost == 1 and st.count == 0 then C = 0 end
    if slots > st.R then
      -- A replay table to grow (its slots so far oldest first): the new slots after them,
      -- the next one the first new one.
      st.table = replay_table(st) .. string.rep('\0', SLOT_SIZE * (slots - st.R))
      st.R, st.next_slot = slots, st.R
      if C == st.C and base == st.base and S == st.S then rare_ops().compact(st, 1) end
    end
    if C ~= st.C or base ~= st.base or S ~= st.S then
      rare_ops().relayout(st, base, C, slots, 1, S)
      at = now - st.base
    end
    if st.C > 0 and st.total + cost >= 256 ^ st.C then
      rare_ops().relayout(st, st.base, 7, st.R, 1) -- the totals outgrow their bytes
    end
    -- Its place: after every entry at or before now (its tie is above theirs).
    local k, found, from = st.count, nil, nil
    if k > 0 and st.last > now then
      k, found, from = search_ops().first_at_least(st, 0, st.count, 1, at + 1)
    end
    local total = nil
    if st.C > 0 and k == st.count then
      total = st.total + cost
    elseif st.C > 0 then
      total = search_ops().total_at(st, k - 1, found, from) + cost
    end
    if st.tail + st.E > st.size or st.version ~= COMPACT_VERSION then
      rare_ops().compact(st, 1)
    end
    local bytes = struct.pack(st.fmt, at, tie, total)
    if k < st.count then
      -- Another clock behind: the later entries move one place up, their totals by cost.
      bytes = bytes .. rare_ops().repack(st, k, st.count - k, cost)
    end
    redis.call('SETRANGE', st.key, st.head + k * st.E, bytes)
    st.fresh = false
    if st.count == 0 or now < st.first then st.first = now end
    if st.count == 0 or now > st.last then st.last = now end
    -- The last entry now (another clock behind leaves the last one as it was).
    if now == st.last then st.next_tie = (tie + 1) % TIE_LIMIT end
    st.tail, st.count, st.total = st.tail + st.E, st.count + 1, st.total + (total and cost or 0)
    if slot then
      -- One write: the header, then the replay table up to and including this admission's
      -- slot (the slots after it keep their bytes).
      local s = st.next_slot * SLOT_SIZE
      local before = ''
      if s > 0 then before = string.sub(replay_table(st), 1, s) end
      st.next_slot = (st.next_slot + 1) % st.R
      redis.call('SETRANGE', st.key, 0, header_bytes(st) .. before .. slot)
      -- The table read with the header is stale now: nothing of this call reads it again
      -- (an add is its window's last change), and a read would fail, not misread.
      st.table, st.bytes, st.dirty, st.table_dirty = false, nil, false, false
    else
      save_header(st)
    end
    redis.call('EXPIRE', st.key, window_ms / 1000 + 1)
  end

  -- Writes the headers that trims changed (a refused decision keeps its trims).
  function log.flush()
    for i = 1, n do
      local st = state[i]
      if st and st.dirty then save_header(st) end
    end
  end

  -- Sets the cost of the entry logged at `at` (unix ms) with `tie` in window i to `cost`
  -- (0 removes it; its member is not needed), when it is still there and has not left
  -- the window: 1, else 0. The running totals after it move by the difference (O(entries
  -- after it)); setting the same cost twice changes nothing.
  function log.set_cost(i, _, at, tie, cost, window_ms)
    local st = compact_header(KEYS[i])
    if not st.exists or st.count == 0 or at <= now - window_ms then return 0 end
    local stored = at - st.base
    -- The first entry at `stored`, then past the ties below `tie` there (in their order):
    -- in the search's slice, then by halves.
    local entry = search_ops().entry
    local k, bytes, from = search_ops().first_at_least(st, 0, st.count, 1, stored, 0,
      st.first - st.base, st.count - 1, st.last - st.base)
    local function past(j)
      local t, e = entry(st, j, bytes, from)
      return t ~= stored or e >= tie
    end
    local hi = st.count
    local read = bytes and from + #bytes / st.E or k
    while k < hi and k < read and not past(k) do k = k + 1 end
    if k < hi and k >= read then
      while k < hi do
        local middle = math.floor((k + hi) / 2)
        if past(middle) then hi = middle else k = middle + 1 end
      end
    end
    if k >= st.count then return 0 end
    local t, e = entry(st, k, bytes, from)
    if t ~= stored or e ~= tie then return 0 end
    local old = 1
    if st.C > 0 then
      local found = search_ops()
      old = found.total_at(st, k, bytes, from) - found.total_at(st, k - 1, bytes, from)
    end
    if cost == old then return 1 end
    if cost ~= 0 and st.C == 0 then rare_ops().relayout(st, st.base, 6, st.R, 0) end
    local delta = cost - old
    if st.C > 0 and st.total + delta >= 256 ^ st.C then
      rare_ops().relayout(st, st.base, 7, st.R, 0)
    end
    local from_k = cost == 0 and k + 1 or k
    local moved = ''
    if from_k < st.count and st.C == 0 then
      moved = value_range(st, st.head + from_k * st.E, st.tail - 1)
    elseif from_k < st.count then
      moved = rare_ops().repack(st, from_k, st.count - from_k, delta)
    end
    -- A short value read whole is written again whole (its header does not move): its new
    -- entries are made here and go with it in one SET. Else the entries after k move.
    local entries = nil
    if st.fresh and st.whole and st.version == SHORT_VERSION then
      entries = string.sub(st.bytes, st.head + 1, st.head + k * st.E) .. moved
    elseif moved ~= '' then
      redis.call('SETRANGE', st.key, st.head + k * st.E, moved)
      st.fresh = false
    end
    if st.C > 0 then st.total = st.total + delta end
    if cost == 0 then
      st.tail, st.count = st.tail - st.E, st.count - 1
      local found = search_ops()
      if st.count > 0 and k == 0 then st.first = st.base + found.entry(st, 0, entries, 0) end
      if st.count > 0 and k == st.count then
        -- The last entry left: the next tie stays above the ties of the new last
        -- millisecond, and does not go back (a new entry in the removed one's millisecond
        -- must not take its tie: a replay of this reconcile would find it).
        local last_at, last_tie = found.entry(st, st.count - 1, entries, 0)
        if st.base + last_at ~= st.last then
          local above = (last_tie + 1) % TIE_LIMIT
          if above ~= 0 and st.next_tie > above then above = st.next_tie end
          st.last, st.next_tie = st.base + last_at, above
        end
      end
    end
    if entries then
      rare_ops().rewrite(st, entries, 0)
    else
      save_header(st)
    end
    return 1
  end

  log.peek_freeing_stamp = log.freeing_stamp
  return log, now
end

-- The storage as the entry scripts see it (lib/zset_log.lua's three names): one string per
-- window; the compact log; a check's reply names its entry by its time and tie (8th).
local KEYS_PER_WINDOW, open_log, TIE_NAMES_ENTRY = 1, compact_log, true
