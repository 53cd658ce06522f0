-- A published job's lock goes from its short grace to its full ttl (G11); a retried job's
-- record learns that its retry went out.
-- KEYS: lock, job record   ARGV: job
-- A plain enqueue's confirmation is HMGET, HSET, PEXPIREAT: the job's record is read only for
-- a retry (the lock marks one with 'y') or when the lock is not the job's (a retry without an
-- enqueue lock). The lock's 'e' is its absolute deadline, so no clock is read.
local lock = redis.call('HMGET', KEYS[1], 'j', 's', 'c', 'e', 'y')
local ours = lock[1] == ARGV[1]
if (lock[5] or not ours) and redis.call('HGET', KEYS[2], 's') == 'q' then
  redis.call('HSET', KEYS[2], 'c', '1')
end
if not ours or lock[2] ~= 'q' or lock[3] ~= '0' then return 0 end
redis.call('HSET', KEYS[1], 'c', '1')
redis.call('PEXPIREAT', KEYS[1], lock[4])
return 1
