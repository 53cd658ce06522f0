-- One scheduler's send of a schedule entry's tick: the first send of a tick takes it, any
-- other send of it (another scheduler, a restarted one) or of an earlier tick (a late
-- scheduler) is answered with the job of the entry's latest tick. The entry keeps one record,
-- "<slot ms>:<job id>", so ticks of any age compare without a record per tick.
-- KEYS: tick   ARGV: slot_ms, job_id, ttl_ms
-- Cost: GET, SET.
local latest = redis.call('GET', KEYS[1])
if latest then
  local sep = string.find(latest, ':', 1, true)
  if tonumber(string.sub(latest, 1, sep - 1)) >= tonumber(ARGV[1]) then
    return string.sub(latest, sep + 1)
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2], 'PX', ARGV[3])
return false
