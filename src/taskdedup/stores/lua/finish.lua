-- The job ended: release its locks, throttle until the ttl, or hand off once (reschedule_once).
-- KEYS: lock, run, job record, fence
-- ARGV: job, throttle (1/0), memory_ms, handoff job ('' = none), attempt ('' = unknown),
--       grace_ms, ttl_ms
local job = ARGV[1]
local now = now_ms()
local rec = redis.call('HMGET', KEYS[3], 's', 'n')
if rec[1] and ARGV[5] ~= '' and rec[2] and rec[2] ~= '' and tonumber(ARGV[5]) < tonumber(rec[2]) then
  return {'stale', '', false}
end
if rec[1] then
  redis.call('HSET', KEYS[3], 's', 'd')
else
  redis.call('HSET', KEYS[3], 's', 'd', 'o', '', 'a', '1', 'n', ARGV[5], 'f', '0', 'm', '0')
end
redis.call('PEXPIRE', KEYS[3], ARGV[3])
release_if_holder(KEYS[2], job)
local lock = redis.call('HMGET', KEYS[1], 'j', 'd', 'e')
if lock[1] ~= job then
  remember_event(KEYS[1], 'finished', job, 'not_holder')
  return {'kept', '', false}
end
if tonumber(lock[2]) > 0 and ARGV[4] ~= '' then
  local payload = hand_off(KEYS[1], KEYS[4], ARGV[4], tonumber(ARGV[7]), tonumber(ARGV[6]), now)
  remember_event(KEYS[1], 'finished', job, 'rescheduled', ARGV[4])
  return {'released', ARGV[4], payload}
end
local left = tonumber(lock[3]) - now
if ARGV[2] == '1' and left > 0 then
  redis.call('HSET', KEYS[1], 's', 't')
  redis.call('PEXPIRE', KEYS[1], left)
  remember_event(KEYS[1], 'finished', job, 'throttled')
else
  redis.call('DEL', KEYS[1])
  remember_event(KEYS[1], 'finished', job, 'released')
end
return {'released', '', false}
