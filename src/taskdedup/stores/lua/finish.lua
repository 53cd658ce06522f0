-- The job ended: release its locks, throttle until the ttl, or hand off once (reschedule_once).
-- KEYS: lock, run, job record
-- ARGV: job, throttle (1/0), memory_ms, handoff job ('' = none), attempt ('' = unknown),
--       grace_ms, ttl_ms
-- Only a hand-off and the duplicates the lock answered are written to the key's history: a job that ended is read from its record,
-- and the lock it freed (or keeps throttled) tells the rest.
local job = ARGV[1]
local rec = redis.call('HMGET', KEYS[3], 's', 'n', 'l')
if rec[1] and ARGV[5] ~= '' and rec[2] and rec[2] ~= '' and tonumber(ARGV[5]) < tonumber(rec[2]) then
  return {'stale', '', false}
end
if rec[1] then
  redis.call('HSET', KEYS[3], 's', 'd')
else
  redis.call('HSET', KEYS[3], 's', 'd', 'o', '', 'a', '1', 'n', ARGV[5], 'f', '0', 'm', '0')
end
redis.call('PEXPIRE', KEYS[3], ARGV[3])
-- the run lock is looked at only when this run took it (or no record says whether it did)
if rec[3] ~= '0' then release_if_holder(KEYS[2], job) end
local lock = redis.call('HMGET', KEYS[1], 'j', 'd', 'e', 'l', 'x')
if lock[1] ~= job then return {'kept', '', false} end
note_duplicates(KEYS[1], job, lock[2], lock[4], lock[5] and 'cancel_requested' or nil)
if tonumber(lock[2] or '0') > 0 and ARGV[4] ~= '' then
  local payload = hand_off(KEYS[1], ARGV[4], tonumber(ARGV[7]), tonumber(ARGV[6]))
  remember_event(KEYS[1], 'finished', job, 'rescheduled', ARGV[4])
  return {'released', ARGV[4], payload}
end
local left = ARGV[2] == '1' and tonumber(lock[3]) - now_ms()  -- (the clock only to throttle)
if left and left > 0 then
  redis.call('HSET', KEYS[1], 's', 't')
  redis.call('PEXPIRE', KEYS[1], left)
else
  redis.call('DEL', KEYS[1])
end
return {'released', '', false}
