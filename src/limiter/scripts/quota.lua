-- One Envoy's report of one RLQS bucket: the twin of `quota::allot`
-- (`limiter::lease::allocate` over the bucket's holders, every floor 0),
-- run atomically in the store.
--
-- KEYS[1]   the bucket's holders: one field per holder id, the value
--           "<offered> <confirmed> <lease end ms> <demand>".
-- ARGV      holder, limit, lease_ms, skew_ms, linger_ms (the window),
--           ttl_ms, enforcing, admitted, demand (requests per window)
-- Returns   { now_ms, share }; the share's lease ends at now_ms + lease_ms.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local limit = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local skew = tonumber(ARGV[4])
local linger = tonumber(ARGV[5])
local ttl = tonumber(ARGV[6])
local enforcing = tonumber(ARGV[7])
local admitted = tonumber(ARGV[8])
local demand = tonumber(ARGV[9])

-- The holders that may still enforce something (or want it); the others
-- are forgotten.
local names, states = {}, {}
local stored = redis.call('HGETALL', KEYS[1])
for i = 1, #stored, 2 do
  local name = stored[i]
  local o, c, e, d = string.match(stored[i + 1], '^(%d+) (%d+) (%d+) (%d+)$')
  local state = { tonumber(o) or 0, tonumber(c) or 0, tonumber(e) or 0, tonumber(d) or 0 }
  if name ~= me and now >= state[3] + skew + linger then
    redis.call('HDEL', KEYS[1], name)
  else
    names[#names + 1] = name
    states[name] = state
  end
end
if not states[me] then
  names[#names + 1] = me
  states[me] = { 0, 0, 0, 0 }
end
table.sort(names)
local n = #names
local shareable = math.max(0, limit - (math.floor(limit / 50) + n))

local confirmed = math.max(enforcing, admitted)
local others = 0
local demands, mine = {}, 0
for j, name in ipairs(names) do
  local i, s = j - 1, states[name]
  if name == me then
    mine = i
    demands[i] = demand
  else
    if now < s[3] + skew + linger then
      others = others + math.max(s[1], s[2])
    end
    -- Its lease ran out: it wants nothing until it reports again.
    demands[i] = (now < s[3] + skew) and s[4] or 0
  end
end

local floors = {}
for i = 0, n - 1 do
  floors[i] = 0
end
local shares = fair_shares(shareable, n, floors, demands)

local share = math.min(shares[mine], math.max(0, shareable - others))
redis.call('HSET', KEYS[1], me, string.format('%d %d %d %d', share, confirmed, now + lease, demand))
redis.call('PEXPIRE', KEYS[1], ttl)
return { now, share }
