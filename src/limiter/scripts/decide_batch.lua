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
-- KEYS             every job's counter hashes (fields w, c, p), job after job
-- ARGV[1]          number of jobs J
-- then per job     n (its number of keys), then per key 6 values: window
--                  length W in ticks, capacity, weight, tick length in ms,
--                  flags (algorithm: 0 sliding window, 1 fixed window,
--                  2 token bucket, 3 GCRA; + 4 = shadow; + 8 x count:
--                  0 if it fits, 1 never (a peek), 2 always (a report)),
--                  rate (a bucket's refill per W)
--
-- Returns, per job: committed (0|1), then per key: fits (0|1) and three
-- values as seen BEFORE this key's own weight — a window's current,
-- previous, elapsed; a bucket's debt, 0, 0 — so the caller derives
-- remaining, retry_after and reset_after with the Rust arithmetic (and
-- checks the script's answer against it).
--
-- A bucket's hash keeps its stamp in w (last refill, or the TAT in whole
-- ticks) and its debt (or the TAT's remainder in units) in c; its TTL is
-- the time until it is full again.
--
-- A job commits when no non-shadow admission or peek is over; then every
-- admission that fits is incremented (a shadow key over its limit is not),
-- and every report is, whatever is left (RedisStore never mixes reports
-- with admissions in one job). A peek never writes. A job that does not
-- commit writes nothing. Counters are read once per batch (HMGET) and
-- written once per batch (HSET + PEXPIRE 2W) however many jobs touch them.
--
-- Every product stays under 2^53: rules bound capacity * W by MAXCW
-- (window.rs MAX_CAPACITY_TIMES_WINDOW, 2^51); a window's counts are
-- clamped to MAXCW / W and a bucket's debt to MAXCW (bucket.rs MAX_DEBT),
-- read and write; Lua numbers are doubles.
local MAXCW = 2251799813685248
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- key -> {window index, current, previous, ttl ms}: the counter as the jobs
-- committed so far leave it.
local state = {}
local dirty = {}
local out = {}
local k = 0
local a = 2

-- The counter `key` as committed so far, reading the hash on first use.
local function stored(key)
  local s = state[key]
  if s == nil then
    local fields = redis.call('HMGET', key, 'w', 'c', 'p')
    s = {tonumber(fields[1]), tonumber(fields[2]) or 0, tonumber(fields[3]) or 0, 0}
    state[key] = s
  end
  return s
end

-- The counts of `key` at window index `idx` as committed so far.
local function counts(key, idx)
  local s = stored(key)
  if s[1] == idx then
    return s[2], s[3]
  elseif s[1] == idx - 1 then
    return 0, s[2]
  end
  return 0, 0
end

local function commit(key, idx, cur, prev, ttl)
  local s = state[key]
  if s[4] == 0 then dirty[#dirty + 1] = key end
  s[1], s[2], s[3], s[4] = idx, cur, prev, ttl
end

for _ = 1, tonumber(ARGV[1]) do
  local n = tonumber(ARGV[a])
  a = a + 1
  local header = #out + 1
  out[header] = 0
  -- What this job would add, per key, until it commits (only a job of
  -- several keys needs it: the same key may appear twice).
  local pending = nil
  if n > 1 then pending = {} end
  -- A one-key job's write, in locals (no table per job).
  local s_key, s_idx, s_cur, s_prev, s_ttl = nil, 0, 0, 0, 0
  local blocked = false
  for _ = 1, n do
    k = k + 1
    local key = KEYS[k]
    local w = tonumber(ARGV[a])
    local cap = tonumber(ARGV[a + 1])
    local weight = tonumber(ARGV[a + 2])
    local tick = tonumber(ARGV[a + 3])
    local flags = tonumber(ARGV[a + 4])
    local rate = tonumber(ARGV[a + 5])
    a = a + 6
    local alg = flags % 4
    local shadow = math.floor(flags / 4) % 2 == 1
    local mode = math.floor(flags / 8)
    -- Written: an admission that fits, or a report; never a peek nor a weight of 0.
    local writes = weight > 0 and mode ~= 1
    local now = math.floor(now_ms / tick)
    local p = pending and pending[key]
    local fits = 0
    local seen1, seen2, seen3

    if alg >= 2 then
      -- A bucket (bucket.rs): its debt at `now`, in units (1 token = w
      -- units, 1 tick refills `rate`), at most MAXCW.
      local full = cap * w
      local stamp, value
      if p then
        stamp, value = p[1], p[2]
      else
        local s = stored(key)
        stamp, value = s[1], s[2]
      end
      local debt = 0
      if stamp ~= nil then
        -- Ticks beyond these pay back the largest debt: no product grows past 2^53.
        local payback = math.ceil(MAXCW / rate)
        if alg == 2 then
          local el = now - stamp
          if el < 0 then el = 0 end
          if el > payback then el = payback end
          if value > MAXCW then value = MAXCW end
          debt = value - el * rate
          if debt < 0 then debt = 0 end
        elseif stamp >= now then
          local ahead = stamp - now
          if ahead > payback then debt = MAXCW else debt = ahead * rate + value end
          if debt > MAXCW then debt = MAXCW end
        end
      end
      local need = weight * w
      if weight <= cap and debt + need <= full then fits = 1 end
      if writes and (fits == 1 or mode == 2) then
        local after = debt + need
        if after > MAXCW then after = MAXCW end
        local ns, nv
        if alg == 2 then
          ns, nv = now, after
        else
          local whole = math.floor(after / rate)
          ns, nv = now + whole, after - whole * rate
        end
        local ttl = math.ceil(after / rate) * tick
        if ttl < 1 then ttl = 1 end
        if pending then
          pending[key] = {ns, nv, 0, ttl}
        else
          s_key, s_idx, s_cur, s_prev, s_ttl = key, ns, nv, 0, ttl
        end
      end
      seen1, seen2, seen3 = debt, 0, 0
    else
      local sliding = alg == 0
      local idx = math.floor(now / w)
      local elapsed = now - idx * w

      local cur, prev
      if p and p[1] == idx then
        cur, prev = p[2], p[3]
      else
        cur, prev = counts(key, idx)
      end
      local maxc = math.floor(MAXCW / w)
      if cur > maxc then cur = maxc end
      if prev > maxc then prev = maxc end
      local counted_prev = prev
      if not sliding then counted_prev = 0 end

      if cur * w + counted_prev * (w - elapsed) + weight * w <= cap * w then fits = 1 end
      -- A peek or a weight of 0 writes nothing: no counter is created or extended.
      if writes and (fits == 1 or mode == 2) then
        local next = cur + weight
        if next > maxc then next = maxc end
        if pending then
          pending[key] = {idx, next, prev, 2 * w * tick}
        else
          s_key, s_idx, s_cur, s_prev, s_ttl = key, idx, next, prev, 2 * w * tick
        end
      end
      seen1, seen2, seen3 = cur, prev, elapsed
    end
    -- A report never blocks: it is counted whatever is left.
    if fits == 0 and mode ~= 2 and not shadow then
      blocked = true
    end
    out[#out + 1] = fits
    out[#out + 1] = seen1
    out[#out + 1] = seen2
    out[#out + 1] = seen3
  end
  if not blocked then
    out[header] = 1
    if s_key then
      commit(s_key, s_idx, s_cur, s_prev, s_ttl)
    elseif pending then
      for key, p in pairs(pending) do
        commit(key, p[1], p[2], p[3], p[4])
      end
    end
  end
end

for _, key in ipairs(dirty) do
  local s = state[key]
  redis.call('HSET', key,
    'w', string.format('%d', s[1]),
    'c', string.format('%d', s[2]),
    'p', string.format('%d', s[3]))
  redis.call('PEXPIRE', key, s[4])
end
return out
