-- One region's report for one global limit, every active key at once:
-- the twin of `limiter::lease::allocate` (docs/design.md §7c), run
-- atomically in the coordination store. All keys of a call belong to one
-- limit and share its hash tag (one cluster slot).
--
-- KEYS[1]   the limit's memory: when this store began to remember its
--           leases (set on the first call, never expiring). Missing, the
--           store has lost them (a restart, a failover): for one lease and
--           margin from then, no region's grant grows above what it says it
--           enforces (or its floor), since leases granted before are unknown.
-- KEYS[2]   the limit's claims: per region index i, w<i> the deployment
--           that reported for the region last and e<i> when its claim
--           ends (a lease from then). Another deployment's report for a
--           region whose claim runs is refused whole, whatever its keys:
--           two deployments under one name would each enforce the
--           region's floor and its grants.
-- KEYS[2+k] one hash per (limit, key); fields per region index i:
--           o<i> the grant offered, c<i> the grant it confirmed,
--           e<i> its lease's end (ms, this server's clock), d<i> its demand,
--           w<i> the deployment that holds region i
-- ARGV      region (0-based), deployment (the reporting region's id), n
--           (regions), floor of each region (n values), limit, lease_ms,
--           skew_ms, linger_ms (how long admissions weigh in a counter),
--           ttl_ms, then per key: enforcing, admitted, demand
-- Returns   { now_ms, grant of key 1, grant of key 2, ... }; each grant's
--           lease ends at now_ms + lease_ms. An error REGION_CLAIMED when
--           another deployment holds the region's lease on a key: two
--           deployments under one region name would count its grant twice.

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = tonumber(ARGV[1])
local deployment = ARGV[2]
local n = tonumber(ARGV[3])
local floors = {}
local floor_sum = 0
for i = 0, n - 1 do
  floors[i] = tonumber(ARGV[4 + i])
  floor_sum = floor_sum + floors[i]
end
local at = 4 + n
local limit = tonumber(ARGV[at])
local lease = tonumber(ARGV[at + 1])
local skew = tonumber(ARGV[at + 2])
local linger = tonumber(ARGV[at + 3])
local ttl = tonumber(ARGV[at + 4])
at = at + 5
redis.call('SET', KEYS[1], now, 'NX')
local remembering = tonumber(redis.call('GET', KEYS[1]))
local amnesia = now < remembering + lease + skew


local fields = {}
for i = 0, n - 1 do
  fields[#fields + 1] = 'o' .. i
  fields[#fields + 1] = 'c' .. i
  fields[#fields + 1] = 'e' .. i
  fields[#fields + 1] = 'd' .. i
end

local claim = redis.call('HMGET', KEYS[2], 'w' .. r, 'e' .. r)
if claim[1] and claim[1] ~= deployment and now < (tonumber(claim[2]) or 0) + skew then
  return redis.error_reply('REGION_CLAIMED region ' .. r .. ' is held by deployment ' .. claim[1])
end
for k = 3, #KEYS do
  local holder = redis.call('HMGET', KEYS[k], 'w' .. r, 'e' .. r)
  if holder[1] and holder[1] ~= deployment and now < (tonumber(holder[2]) or 0) + skew then
    return redis.error_reply('REGION_CLAIMED region ' .. r .. ' is held by deployment ' .. holder[1])
  end
end
redis.call('HSET', KEYS[2], 'w' .. r, deployment, 'e' .. r, now + lease)
redis.call('PEXPIRE', KEYS[2], ttl)

local out = { now }
for k = 3, #KEYS do
  local enforcing = tonumber(ARGV[at])
  local admitted = tonumber(ARGV[at + 1])
  local demand = tonumber(ARGV[at + 2])
  at = at + 3
  local stored = redis.call('HMGET', KEYS[k], unpack(fields))
  local offered, confirmed, ends, demands = {}, {}, {}, {}
  for i = 0, n - 1 do
    offered[i] = tonumber(stored[4 * i + 1]) or floors[i]
    confirmed[i] = tonumber(stored[4 * i + 2]) or floors[i]
    ends[i] = tonumber(stored[4 * i + 3]) or 0
    demands[i] = tonumber(stored[4 * i + 4]) or 0
  end
  demands[r] = demand
  confirmed[r] = math.max(enforcing, admitted)
  local others = 0
  for i = 0, n - 1 do
    if i ~= r then
      if now < ends[i] + skew + linger then
        others = others + math.max(offered[i], confirmed[i], floors[i])
      else
        others = others + floors[i]
      end
      -- Its lease ran out: it wants nothing until it reports again.
      if now >= ends[i] + skew then
        demands[i] = 0
      end
    end
  end
  local room = math.max(0, limit - others)
  local target = fair_shares(limit, n, floors, demands)[r]
  local grant = math.min(math.max(target, floors[r]), room)
  if amnesia then
    grant = math.min(grant, math.max(floors[r], enforcing))
  end
  redis.call('HSET', KEYS[k], 'o' .. r, grant, 'c' .. r, confirmed[r], 'e' .. r, now + lease, 'd' .. r, demand,
    'w' .. r, deployment)
  redis.call('PEXPIRE', KEYS[k], ttl)
  out[#out + 1] = grant
end
return out
