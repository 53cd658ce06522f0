-- RUNNING(job) -> QUEUED(job): a retry keeps its lock and is never a duplicate of itself.
-- Sent before the retry is published: the lock and the job's record wait for the publish's
-- confirmation for grace_ms (G11); the record's 'u' is that deadline, 'c' the confirmation,
-- 'w' when a retry that went out should have come (its delay plus the grace). The lock's 'y'
-- tells the confirmation that a job record waits for it too.
-- KEYS: lock, run, job record   ARGV: job, ttl_ms, attempt ('' = unknown), grace_ms, delay_ms
local job, ttl = ARGV[1], tonumber(ARGV[2])
local grace = math.min(tonumber(ARGV[4]), ttl)
local now = now_ms()
local rec = redis.call('HMGET', KEYS[3], 's', 'n')
if rec[1] and ARGV[3] ~= '' and rec[2] and rec[2] ~= '' and tonumber(ARGV[3]) < tonumber(rec[2]) then
  return 0
end
if rec[1] then
  redis.call('HSET', KEYS[3], 's', 'q', 'c', '0', 'u', int(now + grace),
    'w', int(now + tonumber(ARGV[5]) + grace))
  redis.call('PEXPIRE', KEYS[3], ttl)
end
release_if_holder(KEYS[2], job)
if redis.call('HGET', KEYS[1], 'j') ~= job then return 0 end
redis.call('HSET', KEYS[1], 's', 'q', 'e', int(now + ttl), 'c', '0', 'y', '1')
redis.call('PEXPIRE', KEYS[1], grace)
remember_event(KEYS[1], 'retrying', job)
return 1
