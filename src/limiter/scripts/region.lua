-- One instance's exchange with its region for the global limits
-- (src/global/regional.rs): adds its tallies, records which version of the
-- grants it may enforce, takes or renews the agent role, drains the
-- region's tallies and reads the others' versions when it holds the role,
-- and reads the grants the agent last wrote. Every key shares the hash tag
-- {global}.
--
-- KEYS[1]   the agent role; KEYS[2] the deployment's id; KEYS[3] the
--           instances' versions (field: instance id, value
--           "<version>:<ms>"); KEYS[4] the version of the grants; then per
--           limit its tallies hash and its grants hash
-- ARGV      instance id, role_ms, tally_ttl_ms, a fresh deployment id (set
--           if none is), the version this instance applied (-1: none),
--           how long a version recorded counts (ms), then per limit: n, and
--           n times key, admitted, denied
-- Returns   { now_ms, 1 if the agent else 0, deployment id, version,
--             { per limit: the drained tallies, flat field/value } (agent only),
--             { per limit: the grants hash, flat field/value },
--             the other instances' versions recorded within the time,
--             flat field/value (agent only) }

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local role_ms = tonumber(ARGV[2])
local tally_ttl = tonumber(ARGV[3])
redis.call('SET', KEYS[2], ARGV[4], 'NX')
local deployment = redis.call('GET', KEYS[2])

-- Until this instance says it applied what it reads now, it may enforce
-- what it applied before, or (none) what it reads now.
local version = tonumber(redis.call('GET', KEYS[4]) or '0')
local applied = tonumber(ARGV[5])
local kept_ms = tonumber(ARGV[6])
local enforced = version
if applied >= 0 and applied < version then enforced = applied end
redis.call('HSET', KEYS[3], me, string.format('%d:%d', enforced, now))
redis.call('PEXPIRE', KEYS[3], kept_ms)

local limits = (#KEYS - 4) / 2
local at = 7
for l = 1, limits do
  local tallies = KEYS[3 + 2 * l]
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

local drained, grants, versions = {}, {}, {}
for l = 1, limits do
  if agent == 1 then
    drained[l] = redis.call('HGETALL', KEYS[3 + 2 * l])
    redis.call('DEL', KEYS[3 + 2 * l])
  end
  grants[l] = redis.call('HGETALL', KEYS[4 + 2 * l])
end
if agent == 1 then
  -- An instance that recorded nothing for kept_ms enforces nothing it read.
  local recorded = redis.call('HGETALL', KEYS[3])
  for i = 1, #recorded, 2 do
    local id, value = recorded[i], recorded[i + 1]
    local at_ms = tonumber(string.match(value, ':(%d+)$'))
    if not at_ms or at_ms + kept_ms < now then
      redis.call('HDEL', KEYS[3], id)
    elseif id ~= me then
      versions[#versions + 1] = id
      versions[#versions + 1] = value
    end
  end
end
return { now, agent, deployment, version, drained, grants, versions }
