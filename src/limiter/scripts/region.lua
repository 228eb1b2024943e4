-- One instance's exchange with its region for the global limits
-- (src/global/regional.rs): adds its tallies, takes or renews the agent
-- role, drains the region's tallies when it holds the role, and reads the
-- grants the agent last wrote. Every key shares the hash tag {global}.
--
-- KEYS[1]   the agent role; KEYS[2] the deployment's id; then per limit
--           its tallies hash and its grants hash
-- ARGV      instance id, role_ms, tally_ttl_ms, a fresh deployment id (set
--           if none is), then per limit: n, and n times key, admitted, denied
-- Returns   { now_ms, 1 if the agent else 0, deployment id,
--             { per limit: the drained tallies, flat field/value } (agent only),
--             { per limit: the grants hash, flat field/value } }

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local role_ms = tonumber(ARGV[2])
local tally_ttl = tonumber(ARGV[3])
redis.call('SET', KEYS[2], ARGV[4], 'NX')
local deployment = redis.call('GET', KEYS[2])

local limits = (#KEYS - 2) / 2
local at = 5
for l = 1, limits do
  local tallies = KEYS[1 + 2 * l]
  local n = tonumber(ARGV[at])
  at = at + 1
  for _ = 1, n do
    local key, admitted, denied = ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
    at = at + 3
    if admitted > 0 then redis.call('HINCRBY', tallies, 'a:' .. key, admitted) end
    if denied > 0 then redis.call('HINCRBY', tallies, 'd:' .. key, denied) end
  end
  if n > 0 then redis.call('PEXPIRE', tallies, tally_ttl) end
end

local holder = redis.call('GET', KEYS[1])
local agent = 0
if holder == me then
  redis.call('PEXPIRE', KEYS[1], role_ms)
  agent = 1
elseif not holder then
  redis.call('SET', KEYS[1], me, 'PX', role_ms)
  agent = 1
end

local drained, grants = {}, {}
for l = 1, limits do
  if agent == 1 then
    drained[l] = redis.call('HGETALL', KEYS[1 + 2 * l])
    redis.call('DEL', KEYS[1 + 2 * l])
  end
  grants[l] = redis.call('HGETALL', KEYS[2 + 2 * l])
end
return { now, agent, deployment, drained, grants }
