-- RUNNING(job) -> QUEUED(job): a retry keeps its lock and is never a duplicate of itself.
-- KEYS: lock, run, job record   ARGV: job, ttl_ms, attempt ('' = unknown)
local job, ttl = ARGV[1], tonumber(ARGV[2])
local rec = redis.call('HMGET', KEYS[3], 's', 'n')
if rec[1] and ARGV[3] ~= '' and rec[2] and rec[2] ~= '' and tonumber(ARGV[3]) < tonumber(rec[2]) then
  return 0
end
if rec[1] then
  redis.call('HSET', KEYS[3], 's', 'q')
  redis.call('PEXPIRE', KEYS[3], ttl)
end
release_if_holder(KEYS[2], job)
if redis.call('HGET', KEYS[1], 'j') ~= job then return 0 end
redis.call('HSET', KEYS[1], 's', 'q', 'e', int(now_ms() + ttl))
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
