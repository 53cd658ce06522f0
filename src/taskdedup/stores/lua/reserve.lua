-- Take a slot of a scope if fewer than the limit are live; a member holding one keeps it.
-- KEYS: slots, scope   ARGV: member, limit, ttl_ms, scope name
-- Reply: {granted 1/0, live slots}
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
local count = redis.call('ZCARD', KEYS[1])
if not held and count >= tonumber(ARGV[2]) then return {0, count} end
redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[3])), ARGV[1])
if not held then count = count + 1 end
keep_slots(KEYS[1], KEYS[2], ARGV[4])
return {1, count}
