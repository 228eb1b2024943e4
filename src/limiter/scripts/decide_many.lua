-- Several counters decided together, all or nothing: the multi-descriptor
-- twin of decide.lua, for Envoy's ShouldRateLimit.
--
-- KEYS[i]          counter hashes (fields w, c, p), all in one hash slot
-- ARGV[5i-4 .. 5i] per key: window length W in ticks, capacity, weight,
--                  tick length in ms, flags (1 = sliding, 2 = shadow)
--
-- Each key is checked in order against its stored counts plus what earlier
-- keys of this call would add to the same key. If any non-shadow key does
-- not fit, nothing is written; otherwise every key that fits is incremented
-- (a shadow key over its limit is not).
--
-- Returns {committed (0|1), then per key: fits (0|1), current, previous, elapsed}
-- with the counts as seen BEFORE this key's own weight, so the caller derives
-- remaining, retry_after and reset_after with window.rs.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local pending = {}
local out = {0}
local blocked = false
local writes = {}
for i = 1, #KEYS do
  local base = (i - 1) * 5
  local w = tonumber(ARGV[base + 1])
  local cap = tonumber(ARGV[base + 2])
  local weight = tonumber(ARGV[base + 3])
  local tick = tonumber(ARGV[base + 4])
  local flags = tonumber(ARGV[base + 5])
  local sliding = flags % 2 == 1
  local shadow = math.floor(flags / 2) % 2 == 1

  local now = math.floor(now_ms / tick)
  local idx = math.floor(now / w)
  local elapsed = now - idx * w

  local state = pending[KEYS[i]]
  local cur, prev = 0, 0
  if state ~= nil and state[1] == idx then
    cur, prev = state[2], state[3]
  else
    local stored = redis.call('HMGET', KEYS[i], 'w', 'c', 'p')
    local sw = tonumber(stored[1])
    if sw ~= nil then
      if sw == idx then
        cur = tonumber(stored[2]) or 0
        prev = tonumber(stored[3]) or 0
      elseif sw == idx - 1 then
        prev = tonumber(stored[2]) or 0
      end
    end
  end
  local counted_prev = prev
  if not sliding then counted_prev = 0 end

  local fits = 0
  if cur * w + counted_prev * (w - elapsed) + weight * w <= cap * w then
    fits = 1
    pending[KEYS[i]] = {idx, cur + weight, prev}
    writes[#writes + 1] = {KEYS[i], idx, cur + weight, prev, 2 * w * tick}
  elseif not shadow then
    blocked = true
  end
  out[#out + 1] = fits
  out[#out + 1] = cur
  out[#out + 1] = prev
  out[#out + 1] = elapsed
end

if not blocked then
  out[1] = 1
  for _, wr in ipairs(writes) do
    redis.call('HSET', wr[1],
      'w', string.format('%d', wr[2]),
      'c', string.format('%d', wr[3]),
      'p', string.format('%d', wr[4]))
    redis.call('PEXPIRE', wr[1], wr[5])
  end
end
return out
