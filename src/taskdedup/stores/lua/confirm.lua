-- A published job's lock goes from its short grace to its full ttl (G11).
-- KEYS: lock   ARGV: job
local lock = redis.call('HMGET', KEYS[1], 'j', 's', 'c', 'e')
if lock[1] ~= ARGV[1] or lock[2] ~= 'q' or lock[3] ~= '0' then return 0 end
local left = tonumber(lock[4]) - now_ms()
if left <= 0 then return 0 end
redis.call('HSET', KEYS[1], 'c', '1')
redis.call('PEXPIRE', KEYS[1], left)
return 1
