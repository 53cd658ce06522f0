-- The publish of a tick's job failed: forget the entry's latest tick if it is still that
-- job's, so another scheduler's send of the tick goes out.
-- KEYS: tick   ARGV: job_id
-- Reply: 1 when it was forgotten, else 0.
local latest = redis.call('GET', KEYS[1])
if not latest then return 0 end
local sep = string.find(latest, ':', 1, true)
if string.sub(latest, sep + 1) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
