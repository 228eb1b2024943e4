-- Many decisions in one script call: the Redis side of limiter/window.rs
-- (`roll` + the admission test of `decide`) and limiter/bucket.rs (the
-- token bucket and GCRA on a bucket's debt). RedisStore coalesces the
-- decisions that arrive while a connection's previous call is in flight
-- into one call of this script, so Redis parses one command, runs one script
-- and reads TIME once per batch instead of once per decision.
--
-- A batch is a list of jobs; a job is one decision over one or more
-- counters (a Check, or one ShouldRateLimit request), all or nothing.
-- Jobs run in order, each on top of what the jobs before it committed, so
-- the result is exactly that of running them one after another.
--
-- KEYS             every job's counters, job after job; or none, and
--                  then the keys are inline in ARGV (below)
-- ARGV[1]          number of read runs R, then R run lengths: the keys,
--                  in order, are read run by run (one MGET per run, in
--                  chunks of 1,000). One server sends one run of all keys.
--                  A Redis Cluster call that carries several slots of one
--                  node passes its keys inline (declared keys must share
--                  one slot) with one run per slot (so must an MGET).
-- then, inline     every key, when KEYS is empty
-- then             number of specs S: the distinct counter parameters of
--                  the batch (usually one per rule)
-- then per spec    5 values: window length W in ticks, capacity, tick
--                  length in ms, flags (algorithm: 0 sliding window,
--                  1 fixed window, 2 token bucket, 3 GCRA, 4 first-hit
--                  window, 5 requests in flight; + 8 = shadow; + 16 x
--                  count: 0 if it fits, 1 never (a peek), 2 always (a
--                  report; in flight: slots given back); + 64 = the
--                  counter's own clock follows; + 128 = a refund
--                  follows), rate (a bucket's refill per W); then, with
--                  flag 64, now in ticks (a calendar period's clock,
--                  limiter/calendar.rs: the period's number x W + the
--                  ticks elapsed in it), which replaces Redis' clock in
--                  the arithmetic (not in the expiries); then, with flag
--                  128, the window r a report gives its weight back to
--                  (a settlement below its reservation, counted in
--                  window r: taken from this window's count when r is
--                  this window, from the previous one's when r is that
--                  one, else nothing; a bucket's debt shrinks by it)
-- then             number of jobs J
-- then per job     a job of one key: that key's entry; a job of n > 1
--                  keys: 0, n, then each key's entry
-- a key's entry    its spec as a number: p (its 1-based position) when
--                  the weight is 1, S + p when the weight follows as the
--                  next value; negated when the key occurs more than once
--                  in the call. A key that occurs once is read and
--                  written by nothing else, so it is written at once,
--                  with no state kept.
--
-- Returns Redis' clock, now_ms (Unix ms), then per job: for a job of
-- several keys whether it committed (0|1) (a one-key job commits exactly
-- when its key fits, is a report or is shadow), then per key: fits (0|1)
-- and what it saw BEFORE this key's own weight:
-- a window's current and previous counts (2 values; a first-hit window's
-- count and start in ticks), or a bucket's debt (1 value). The caller
-- derives elapsed from now_ms and the spec (and a first-hit start), and
-- remaining, retry_after and reset_after with the Rust arithmetic (and
-- checks the script's answer against it).
--
-- Each counter is one string of four little-endian doubles (struct, 32
-- bytes): a window's (index, current, previous, expiry), a first-hit
-- window's (start in ticks, count, -4, expiry), or a bucket's
-- (stamp, value, -algorithm code, expiry) where the stamp is the last
-- refill (token bucket) or the TAT in whole ticks (GCRA) and the value
-- the debt then, or the TAT's remainder in units. The expiry (Unix ms) is
-- the key's own, so a write knows whether it must move it. The third
-- value tells an aligned window (>= 0) from the other kinds. A window
-- expires when it stops mattering (the end of the next window; a
-- first-hit window's own end), a bucket at twice the time until it is
-- full again, set only when its expiry falls short. A
-- value of any other shape (a key of another type or length, or of
-- another algorithm) reads as no counter and is overwritten.
--
-- A job commits when no non-shadow admission or peek is over; then every
-- admission that fits is incremented (a shadow key over its limit is not),
-- and every report is, whatever is left (RedisStore never mixes reports
-- with admissions in one job). A peek never writes. A job that does not
-- commit writes nothing. Counters are read once per batch (one MGET) and
-- each written counter once per batch (one SET with its expiry).
--
-- Every product stays under 2^53: rules bound capacity * W by MAXCW
-- (window.rs MAX_CAPACITY_TIMES_WINDOW, 2^51); a window's counts are
-- clamped to MAXCW / W and a bucket's debt to MAXCW (bucket.rs MAX_DEBT),
-- read and write; Lua numbers are doubles.
local MAXCW = 2251799813685248
local floor, ceil, tonumber, format, setmetatable = math.floor, math.ceil, tonumber, string.format, setmetatable
local call, pack, decode, unpack = redis.call, struct.pack, struct.unpack, unpack
local KEYS, ARGV = KEYS, ARGV
local LAYOUT = '<dddd'

local t = call('TIME')
local now_ms = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)

-- The keys: KEYS, or inline in ARGV after the run lengths. Key k is
-- K[kb + k].
local runs = tonumber(ARGV[1])
local a = runs + 2
local K, kb = KEYS, 0
if #KEYS == 0 then
  K, kb = ARGV, a - 1
  for r = 2, runs + 1 do a = a + tonumber(ARGV[r]) end
end

-- Every key's stored value, read before anything is written, run by run
-- (in chunks: unpack is bounded). In a cluster, a key this node does not
-- serve (a stale slot map) fails the call here, before any write.
local stored = {}
do
  local k0 = 0
  for r = 2, runs + 1 do
    local stop = k0 + tonumber(ARGV[r])
    local first = k0 + 1
    while first <= stop do
      local last = first + 999
      if last > stop then last = stop end
      local values = call('MGET', unpack(K, kb + first, kb + last))
      for i = 1, last - first + 1 do
        stored[first + i - 1] = values[i]
      end
      first = last + 1
    end
    k0 = stop
  end
end

-- Per spec, what every key of it shares: the parameters and what follows
-- from them and `now` alone. Keyed by the entry as ARGV spells it, so a
-- key finds its spec without parsing a number: `specs` when the key occurs
-- once in the call, `repeated` (the entry negated) when more than once;
-- `weight` is 1, or false when the key's weight follows its entry (that
-- variant reads everything else from the first through its metatable: one
-- table of a dozen fields less per spec and call, for the rarer keys).
-- Entries are spelled with format('%d'): tostring is a costly %.14g.
local specs = {}
local repeated = {}
local nspecs = tonumber(ARGV[a])
a = a + 1
for s = 1, nspecs do
  local w, cap, tick, flags, rate =
    tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  a = a + 5
  local alg = flags % 8
  -- `base` + ticks x tick is the Unix ms of a tick of this spec's clock.
  local now, base, refund = floor(now_ms / tick), 0, nil
  if flags % 128 >= 64 then
    now = tonumber(ARGV[a])
    base = now_ms - now * tick
    a = a + 1
  end
  if flags >= 128 then
    refund = tonumber(ARGV[a])
    a = a + 1
  end
  local idx = floor(now / w)
  local one = {
    weight = 1,
    w = w, cap = cap, tick = tick, alg = alg, rate = rate, now = now,
    shadow = floor(flags / 8) % 2 == 1, mode = floor(flags / 16) % 4, base = base, refund = refund,
    -- The capacity in units (capacity * W): a window's bound, a full bucket.
    capw = cap * w,
    -- A window: the current one, the largest count, the previous
    -- window's share of the estimate, and when a counter written now stops
    -- mattering (the next window's end):
    -- a window's share of the estimate (W - elapsed; 0 for a fixed window,
    -- all of it for slots in flight),
    idx = idx, maxc = floor(MAXCW / w),
    prevw = (alg == 1) and 0 or ((alg == 5) and w or (w - (now - idx * w))),
    expiry = base + (idx + 2) * w * tick,
    -- A bucket: the ticks that pay back the largest debt (no product
    -- grows past 2^53 beyond them).
    payback = ceil(MAXCW / rate),
  }
  local given = setmetatable({weight = false}, {__index = one})
  specs[format('%d', s)], repeated[format('%d', -s)] = one, one
  specs[format('%d', nspecs + s)], repeated[format('%d', -nspecs - s)] = given, given
end

-- key -> the counter as the jobs committed so far leave it: {a, b, c,
-- expiry it will have, expiry it has}; `dirty` lists the keys written, in
-- order of first write. Only keys that occur more than once in the call
-- are kept here: the others are written as soon as their job is decided.
local state = {}
local dirty = {}
local ndirty = 0
local out = {now_ms}
local o = 1
local k = 0

-- Writes a counter: (a, b, c) until `expiry`, which the key gets when it
-- is past `kept` (the expiry the key has); else the key keeps its own. An
-- expiry is spelled once per call: Lua spells a number with
-- snprintf("%.14g"), which cost more than the SET's own work, and the
-- counters of one spec mostly share their expiry.
local spelled = {}
local function write(key, x, y, z, expiry, kept)
  local v = pack(LAYOUT, x, y, z, expiry)
  if expiry > kept then
    local text = spelled[expiry]
    if text == nil then
      text = format('%d', expiry)
      spelled[expiry] = text
    end
    call('SET', key, v, 'PXAT', text)
  else
    call('SET', key, v, 'KEEPTTL')
  end
end

-- Commits a write of a counter: (a, b, c), kept until `need` at least;
-- when its expiry falls short, it becomes `later`. `expiry` is what the
-- stored value ensures (used on the counter's first write).
local function commit(key, x, y, z, need, later, expiry)
  local s = state[key]
  if s == nil then
    s = {x, y, z, expiry, expiry}
    state[key] = s
    ndirty = ndirty + 1
    dirty[ndirty] = key
  else
    s[1], s[2], s[3] = x, y, z
  end
  if s[4] < need then s[4] = later end
end

local jobs = tonumber(ARGV[a])
a = a + 1
for _ = 1, jobs do
  -- A job of several keys: what it would write, per key, until it commits
  -- (the same key may appear twice), and where its answer says whether it
  -- committed. A one-key job commits whatever it writes (a write means it
  -- fits, or is a report, which never blocks), so its answer need not say.
  local n, pending, header = 1, nil, nil
  if ARGV[a] == '0' then
    n = tonumber(ARGV[a + 1])
    a = a + 2
    pending = {}
    o = o + 1
    header = o
    out[header] = 0
  end
  local blocked = false
  for _ = 1, n do
    k = k + 1
    local key = K[kb + k]
    local sp = specs[ARGV[a]]
    local sole = true
    if sp == nil then
      sp = repeated[ARGV[a]]
      sole = false
    end
    local weight = sp.weight
    if not weight then
      weight = tonumber(ARGV[a + 1])
      a = a + 1
    end
    a = a + 1
    local w, cap, mode, alg = sp.w, sp.cap, sp.mode, sp.alg
    -- The counter as committed so far (or as this job would leave it):
    -- (a, b, c, expiry), or (nil, 0, 0, 0) when there is none. `c` tells a
    -- window (its previous count, >= 0) from a bucket (minus its
    -- algorithm code): a value of the other kind, of another length or of
    -- another type reads as none.
    local x, y, z, e = nil, 0, 0, 0
    local s = nil
    if not sole then s = (pending and pending[key]) or state[key] end
    if s then
      x, y, z, e = s[1], s[2], s[3], s[4]
    else
      local v = stored[k]
      if v and #v == 32 then x, y, z, e = decode(LAYOUT, v) end
    end
    -- Written: an admission that fits, or a report; never a peek nor a weight of 0.
    local writes = weight > 0 and mode ~= 1
    local fits = 0
    local nx, ny, nz, need, later

    if alg == 2 or alg == 3 then
      -- A bucket (bucket.rs): its debt at `now`, in units (1 token = w
      -- units, 1 tick refills `rate`), at most MAXCW. Stored as (last
      -- refill, debt then) for the token bucket, (TAT in whole ticks, the
      -- TAT's remainder in units) for GCRA; c = -alg.
      local rate, now = sp.rate, sp.now
      local debt = 0
      if z == -alg then
        local payback = sp.payback
        if alg == 2 then
          local el = now - x
          if el < 0 then el = 0 end
          if el > payback then el = payback end
          if y > MAXCW then y = MAXCW end
          debt = y - el * rate
          if debt < 0 then debt = 0 end
        elseif x >= now then
          local ahead = x - now
          if ahead > payback then debt = MAXCW else debt = ahead * rate + y end
          if debt > MAXCW then debt = MAXCW end
        end
      end
      local units = weight * w
      if weight <= cap and debt + units <= sp.capw then fits = 1 end
      if writes and (fits == 1 or mode == 2) then
        local after = debt + units
        if sp.refund then
          after = debt - units
          if after < 0 then after = 0 end
        end
        if after > MAXCW then after = MAXCW end
        if alg == 2 then
          nx, ny = now, after
        else
          local whole = floor(after / rate)
          nx, ny = now + whole, after - whole * rate
        end
        nz = -alg
        -- Until it is full again; when that is past its expiry, twice as
        -- long, so the writes that follow keep the expiry it has.
        local full_in = ceil(after / rate) * sp.tick
        if full_in < 1 then full_in = 1 end
        need = now_ms + full_in
        later = need + full_in
      end
      out[o + 1] = fits
      out[o + 2] = debt
      o = o + 2
    else
      -- A window, stored as (index, current, previous).
      -- A first-hit window (window.rs `locate`) is stored as (start,
      -- count, -4): open until start + W (a clock behind its start keeps
      -- its count), else a new one starts now; its previous count is 0,
      -- and its start is answered in the previous count's place.
      local idx, maxc, expiry = sp.idx, sp.maxc, sp.expiry
      local cur, prev = 0, 0
      if alg == 4 then
        idx = sp.now
        if z == -4 and idx - x < w then idx, cur = x, y end
        expiry = sp.base + (idx + w) * sp.tick
      elseif z >= 0 then
        if x == idx then
          cur, prev = y, z
        elseif x == idx - 1 then
          prev = y
        elseif x == idx + 1 then
          -- The next window's counter (written by a clock ahead: window.rs
          -- `roll`): counted in its window, both counts as current.
          idx, cur = x, y + z
          expiry = sp.base + (x + 2) * w * sp.tick
        end
      end
      if cur > maxc then cur = maxc end
      if prev > maxc then prev = maxc end
      -- current * W + previous * (W - elapsed) + weight * W <= capacity * W
      if (cur + weight) * w + prev * sp.prevw <= sp.capw then fits = 1 end
      -- A peek or a weight of 0 writes nothing: no counter is created or extended.
      if writes and (fits == 1 or mode == 2) then
        local r = sp.refund
        if r then
          -- A settlement's refund (window.rs Seen::refunded): from the
          -- window it was counted in, while that one still counts.
          local c, p = cur, prev
          if r == idx then
            c = c - weight
            if c < 0 then c = 0 end
          elseif r == idx - 1 then
            p = p - weight
            if p < 0 then p = 0 end
          end
          nx, ny, nz, need = idx, c, (alg == 4) and -4 or p, expiry
        elseif alg == 5 and mode == 2 then
          -- Slots given back (window.rs Seen::reported): the previous
          -- window's first, never below 0.
          local back = weight
          if back > prev then back = prev end
          local rest = cur - (weight - back)
          if rest < 0 then rest = 0 end
          nx, ny, nz, need = idx, rest, prev - back, expiry
        else
          local next = cur + weight
          if next > maxc then next = maxc end
          nx, ny, nz, need = idx, next, (alg == 4) and -4 or prev, expiry
        end
        later = need
      end
      out[o + 1] = fits
      out[o + 2] = cur
      out[o + 3] = (alg == 4) and idx or prev
      o = o + 3
    end
    if need then
      if pending then
        pending[key] = {nx, ny, nz, e, need, later}
      elseif sole then
        -- Its only write in this call: now, with no state kept. This is
        -- write(key, nx, ny, nz, e < need and later or e, e) inlined: a
        -- Lua function call cost ~700 instructions per key here (2.5 %).
        if e < need then
          local text = spelled[later]
          if text == nil then
            text = format('%d', later)
            spelled[later] = text
          end
          call('SET', key, pack(LAYOUT, nx, ny, nz, later), 'PXAT', text)
        else
          call('SET', key, pack(LAYOUT, nx, ny, nz, e), 'KEEPTTL')
        end
      else
        commit(key, nx, ny, nz, need, later, e)
      end
    end
    -- A report never blocks: it is counted whatever is left. (Only a job
    -- of several keys asks: a one-key job's write already followed.)
    if header and fits == 0 and mode ~= 2 and not sp.shadow then
      blocked = true
    end
  end
  if header and not blocked then
    out[header] = 1
    for key, p in pairs(pending) do
      commit(key, p[1], p[2], p[3], p[5], p[6], p[4])
    end
  end
end

-- One SET per counter written more than once (the others were written
-- at once); its expiry only when it must move.
for i = 1, ndirty do
  local s = state[dirty[i]]
  write(dirty[i], s[1], s[2], s[3], s[4], s[5])
end
return out
