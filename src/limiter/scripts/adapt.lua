-- Adaptive limits: the Redis side of limiter/adaptive.rs (`exchange` and
-- `step`, its twin: the same arithmetic on the same doubles). One call
-- exchanges every rule an instance has due; the keys share the
-- `{adaptive}` hash slot.
--
-- KEYS             one hash per rule: limit, index, s, f, o (the current
--                  limit, the interval its tally belongs to, and that
--                  interval's successes, failures and overloads so far)
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
  local state = redis.call('HMGET', KEYS[k], 'limit', 'index', 's', 'f', 'o')
  local limit, s, f, o
  if not state[1] or not state[2] then
    limit, s, f, o = tonumber(ARGV[a + 2]), 0, 0, 0
  else
    limit = tonumber(state[1])
    local stored = tonumber(state[2])
    s, f, o = tonumber(state[3]) or 0, tonumber(state[4]) or 0, tonumber(state[5]) or 0
    if stored < index then
      -- A later interval: the one that ended decides, once; an older
      -- tally is no evidence of now.
      if stored + 1 == index then
        local total = s + f + o
        if total > 0 then
          if f + o > total * tonumber(ARGV[a + 7]) then
            limit = math.floor(limit * tonumber(ARGV[a + 6]))
          else
            limit = limit + tonumber(ARGV[a + 5])
          end
        end
      end
      s, f, o = 0, 0, 0
    else
      index = stored
    end
  end
  if limit < min then limit = min end
  if limit > max then limit = max end
  s = s + tonumber(ARGV[a + 8])
  f = f + tonumber(ARGV[a + 9])
  o = o + tonumber(ARGV[a + 10])
  local function int(x) return string.format('%.0f', x) end
  redis.call('HSET', KEYS[k], 'limit', int(limit), 'index', int(index), 's', int(s), 'f', int(f), 'o', int(o))
  redis.call('PEXPIRE', KEYS[k], ttl)
  limits[k] = limit
end
return limits
