-- An instance says it applied the grants of a version it read
-- (src/global/regional.rs): its record in the instances' versions becomes
-- that version, at the time of the exchange it read them in, unless a
-- later exchange already recorded something (a late call changes nothing).
--
-- KEYS[1]   the instances' versions
-- ARGV      instance id, version, ms of the exchange that read it
-- Returns   1 if recorded, else 0

local at_ms = tonumber(ARGV[3])
local value = redis.call('HGET', KEYS[1], ARGV[1])
if not value then return 0 end
local recorded_ms = tonumber(string.match(value, ':(%d+)$'))
if recorded_ms and recorded_ms > at_ms then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. ARGV[3])
return 1
