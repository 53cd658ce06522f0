-- An idempotency key: the first submission's job and fingerprint, or the recorded ones.
-- The record is shaped like an enqueue lock, so confirm and release work on it unchanged.
-- KEYS: record   ARGV: job, fingerprint, ttl_ms, grace_ms, replaces (a job id or '')
-- Reply: "<state> <fingerprint> <job>": state 1 = ours now, 0 = another job's, p = another
-- job's whose publish is not confirmed yet (it may still fail and free the key).
local rec = redis.call('HMGET', KEYS[1], 'j', 'p', 'c')
if rec[1] and rec[1] ~= ARGV[5] then
  -- a record without a ttl (not one we wrote, G9) would answer for good: it gets this ttl
  if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
  local state = '0'
  if rec[3] == '0' then state = 'p' end
  return state .. ' ' .. rec[2] .. ' ' .. rec[1]
end
local ttl, grace = tonumber(ARGV[3]), tonumber(ARGV[4])
local confirmed = '0'
if rec[1] or grace >= ttl then confirmed = '1'; grace = ttl end
redis.call('HSET', KEYS[1], 'j', ARGV[1], 'p', ARGV[2], 's', 'q', 'f', '0', 'd', '0',
  'e', int(now_ms() + ttl), 'c', confirmed)
redis.call('PEXPIRE', KEYS[1], grace)
return '1 ' .. ARGV[2] .. ' ' .. ARGV[1]
