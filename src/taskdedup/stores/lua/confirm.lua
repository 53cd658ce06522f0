-- Published jobs' locks go from their short grace to their full ttl (G11); a retried job's
-- record learns that its retry went out. One call confirms a whole batch (on a Cluster, one
-- call per job: a script's keys must share a slot).
-- KEYS: lock, job record [, lock, job record ...]   ARGV: job [, job ...] (one per pair)
--   [, duplicates [, duplicates ...] (one per pair: answered with the job by its producer while
--   this confirmation waited there; counted on the lock if the job still holds it)]
-- Reply: how many locks were confirmed.
-- Each job costs HMGET, HSET, PEXPIREAT: its record is read only for a retry (the lock marks
-- one with 'y') or when the lock is not the job's (a retry without an enqueue lock). The
-- lock's 'e' is its absolute deadline, so no clock is read. A record that is not ours (the
-- wrong type: an error reply) is passed over, so it cannot hold back the rest of the batch.
local function fields(key, ...)
  local got = redis.pcall('HMGET', key, ...)
  if type(got) == 'table' and got.err then return nil end
  return got
end
local confirmed = 0
local pairs_ = #KEYS / 2
for i = 1, pairs_ do
  local lock_key, rec_key, job = KEYS[2 * i - 1], KEYS[2 * i], ARGV[i]
  local lock = fields(lock_key, 'j', 's', 'c', 'e', 'y')
  if lock then
    local ours = lock[1] == job
    local dups = tonumber(ARGV[pairs_ + i] or '0')
    if ours and dups > 0 then redis.call('HINCRBY', lock_key, 'd', dups) end
    if lock[5] or not ours then
      local rec = fields(rec_key, 's')
      if rec and rec[1] == 'q' then redis.call('HSET', rec_key, 'c', '1') end
    end
    if ours and lock[2] == 'q' and lock[3] == '0' then
      redis.call('HSET', lock_key, 'c', '1')
      redis.call('PEXPIREAT', lock_key, lock[4])
      confirmed = confirmed + 1
    end
  end
end
return confirmed
