-- Adaptive limits: the Redis side of limiter/adaptive.rs (`exchange` and
-- `step`, its twin: the same arithmetic on the same doubles). One call
-- exchanges every rule an instance has due; the keys share the
-- `{adaptive}` hash slot.
--
-- KEYS             one hash per rule: limit, index, s, f, o, c (the
--                  current limit, the interval its tally belongs to, that
--                  interval's successes, failures and overloads so far,
--                  and 1 when the last step decreased the limit)
-- ARGV, per key    10 values: the caller's interval index, initial limit,
--                  min, max, increase, decrease, max_failure_ratio, then
--                  the caller's successes, failures and overloads since
--                  its last exchange
-- ARGV[last]       the keys' time to live in ms
--
-- Returns the current limit of each key, in order.
local ttl = ARGV[#ARGV]
local limits = {}
for k = 1, #KEYS do
  local a = (k - 1) * 10
  local index = tonumber(ARGV[a + 1])
  local min, max = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local function clamp(x)
    if x < min then return min end
    if x > max then return max end
    return x
  end
  local state = redis.call('HMGET', KEYS[k], 'limit', 'index', 's', 'f', 'o', 'c')
  local limit, s, f, o, c
  if not state[1] or not state[2] then
    limit, s, f, o, c = tonumber(ARGV[a + 2]), 0, 0, 0, 0
  else
    limit = tonumber(state[1])
    local stored = tonumber(state[2])
    s, f, o = tonumber(state[3]) or 0, tonumber(state[4]) or 0, tonumber(state[5]) or 0
    c = tonumber(state[6]) or 0
    if stored < index then
      -- A later interval: the one that ended decides, once, unless the
      -- step before decreased the limit; an older tally is no evidence
      -- of now.
      limit = clamp(limit)
      local before = limit
      local total = s + f + o
      if stored + 1 == index and c == 0 and total > 0 then
        if f + o > total * tonumber(ARGV[a + 7]) then
          limit = clamp(math.floor(limit * tonumber(ARGV[a + 6])))
        else
          limit = clamp(limit + tonumber(ARGV[a + 5]))
        end
      end
      s, f, o = 0, 0, 0
      if limit < before then c = 1 else c = 0 end
    else
      index = stored
    end
  end
  limit = clamp(limit)
  s = s + tonumber(ARGV[a + 8])
  f = f + tonumber(ARGV[a + 9])
  o = o + tonumber(ARGV[a + 10])
  local function int(x) return string.format('%.0f', x) end
  redis.call('HSET', KEYS[k], 'limit', int(limit), 'index', int(index), 's', int(s), 'f', int(f), 'o', int(o), 'c', c)
  redis.call('PEXPIRE', KEYS[k], ttl)
  limits[k] = limit
end
return limits
