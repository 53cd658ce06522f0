-- Renew one running job's lease on its record, enqueue lock and run lock; 1 if any was held,
-- 2 if its lock was, and a newer submission asked it to stop ('x': supersede, cancel).
-- KEYS: lock, run, job record   ARGV: job, lease_ms
local job, lease = ARGV[1], tonumber(ARGV[2])
local now = now_ms()
local alive = 0
local rec = redis.call('HMGET', KEYS[3], 's', 'm')
if rec[1] == 'r' then
  redis.call('HSET', KEYS[3], 'u', int(now + lease))
  redis.call('PEXPIRE', KEYS[3], lease + tonumber(rec[2]))
  alive = 1
end
local lock = redis.call('HMGET', KEYS[1], 'j', 's', 'x')
if lock[1] == job and lock[2] == 'r' then
  redis.call('PEXPIRE', KEYS[1], lease)
  alive = 1
  if lock[3] == '1' then alive = 2 end
end
if redis.call('HGET', KEYS[2], 'j') == job then
  redis.call('PEXPIRE', KEYS[2], lease)
  if alive == 0 then alive = 1 end
end
return alive
