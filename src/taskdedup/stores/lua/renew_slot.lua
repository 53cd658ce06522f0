-- A running job's slot lives one more lease. 1 if it still held a live slot.
-- KEYS: slots, scope   ARGV: member, lease_ms, scope name
local now = now_ms()
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[2])), ARGV[1])
keep_slots(KEYS[1], KEYS[2], ARGV[3])
return 1
