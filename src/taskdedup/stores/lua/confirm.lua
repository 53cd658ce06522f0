-- A published job's lock goes from its short grace to its full ttl (G11); a retried job's
-- record learns that its retry went out.
-- KEYS: lock, job record   ARGV: job
if redis.call('HGET', KEYS[2], 's') == 'q' then redis.call('HSET', KEYS[2], 'c', '1') end
local lock = redis.call('HMGET', KEYS[1], 'j', 's', 'c', 'e')
if lock[1] ~= ARGV[1] or lock[2] ~= 'q' or lock[3] ~= '0' then return 0 end
local left = tonumber(lock[4]) - now_ms()
if left <= 0 then return 0 end
redis.call('HSET', KEYS[1], 'c', '1')
redis.call('PEXPIRE', KEYS[1], left)
return 1
