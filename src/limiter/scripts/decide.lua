-- Sliding-window counter decision: the Lua twin of limiter/window.rs
-- (`roll` + the admission test of `decide`). Atomic per key.
--
-- KEYS[1]  counter hash  rl:{<user_id>}:<rule_id>   fields w (window index), c (current), p (previous)
-- ARGV[1]  window length W in ms
-- ARGV[2]  capacity = floor(limit * burst_capacity)
-- ARGV[3]  weight of this request (<= capacity; larger weights never reach Redis)
--
-- Returns {admitted (0|1), current, previous, elapsed_ms}, the counts being those
-- BEFORE this request was added, so the caller can derive remaining,
-- retry_after and reset_after with the same pure function the memory store uses.
--
-- Time is the server's (TIME), so instances with skewed clocks agree. Every
-- product below stays under 2^53 because rules bound capacity * W (see
-- window.rs MAX_CAPACITY_TIMES_WINDOW); Lua numbers are doubles.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local weight = tonumber(ARGV[3])

local idx = math.floor(now / w)
local elapsed = now - idx * w

local stored = redis.call('HMGET', KEYS[1], 'w', 'c', 'p')
local cur, prev = 0, 0
local sw = tonumber(stored[1])
if sw ~= nil then
  if sw == idx then
    cur = tonumber(stored[2]) or 0
    prev = tonumber(stored[3]) or 0
  elseif sw == idx - 1 then
    prev = tonumber(stored[2]) or 0
  end
end

local admitted = 0
if cur * w + prev * (w - elapsed) + weight * w <= cap * w then
  admitted = 1
  -- '%d' keeps large integers out of Lua's '%.14g' number-to-string conversion.
  redis.call('HSET', KEYS[1],
    'w', string.format('%d', idx),
    'c', string.format('%d', cur + weight),
    'p', string.format('%d', prev))
  redis.call('PEXPIRE', KEYS[1], 2 * w)
end
return {admitted, cur, prev, elapsed}
