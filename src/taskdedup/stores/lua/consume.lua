-- A reservation's slot passes to the published job. 1 if the reservation was still held.
-- KEYS: slots, scope   ARGV: member, job, ttl_ms, scope name
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms())  -- as reserve: expired slots are gone
local had = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[1], int(now_ms() + tonumber(ARGV[3])), ARGV[2])
keep_slots(KEYS[1], KEYS[2], ARGV[4])
return had
