-- Many decisions in one script call: the Redis side of limiter/window.rs
-- (`roll` + the admission test of `decide`). RedisStore coalesces the
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
-- then per job     n (its number of keys), then per key 5 values: window
--                  length W in ticks, capacity, weight, tick length in ms,
--                  flags (1 = sliding, 2 = shadow)
--
-- Returns, per job: committed (0|1), then per key: fits (0|1), current,
-- previous, elapsed; the counts as seen BEFORE this key's own weight, so the
-- caller derives remaining, retry_after and reset_after with window.rs.
--
-- A job commits when no non-shadow key is over; then every key that fits is
-- incremented (a shadow key over its limit is not). A job that does not
-- commit writes nothing. Counters are read once per batch (HMGET) and
-- written once per batch (HSET + PEXPIRE 2W) however many jobs touch them.
--
-- Every product stays under 2^53: rules bound capacity * W (window.rs
-- MAX_CAPACITY_TIMES_WINDOW), and Lua numbers are doubles.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- key -> {window index, current, previous, ttl ms}: the counter as the jobs
-- committed so far leave it.
local state = {}
local dirty = {}
local out = {}
local k = 0
local a = 2

-- The counts of `key` at window index `idx` as committed so far, reading
-- the hash on first use.
local function counts(key, idx)
  local s = state[key]
  if s == nil then
    local stored = redis.call('HMGET', key, 'w', 'c', 'p')
    s = {tonumber(stored[1]), tonumber(stored[2]) or 0, tonumber(stored[3]) or 0, 0}
    state[key] = s
  end
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
    a = a + 5
    local sliding = flags % 2 == 1
    local shadow = flags >= 2

    local now = math.floor(now_ms / tick)
    local idx = math.floor(now / w)
    local elapsed = now - idx * w

    local cur, prev
    local p = pending and pending[key]
    if p and p[1] == idx then
      cur, prev = p[2], p[3]
    else
      cur, prev = counts(key, idx)
    end
    local counted_prev = prev
    if not sliding then counted_prev = 0 end

    local fits = 0
    if cur * w + counted_prev * (w - elapsed) + weight * w <= cap * w then
      fits = 1
      -- A weight of 0 (a peek) writes nothing: no counter is created or extended.
      if weight == 0 then
      elseif pending then
        pending[key] = {idx, cur + weight, prev, 2 * w * tick}
      else
        s_key, s_idx, s_cur, s_prev, s_ttl = key, idx, cur + weight, prev, 2 * w * tick
      end
    elseif not shadow then
      blocked = true
    end
    out[#out + 1] = fits
    out[#out + 1] = cur
    out[#out + 1] = prev
    out[#out + 1] = elapsed
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
