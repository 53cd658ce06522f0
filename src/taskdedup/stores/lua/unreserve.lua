-- Free a member's slot. 1 if it held one.
-- KEYS: slots, scope   ARGV: member, scope name
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms())  -- as reserve: expired slots are gone
local had = redis.call('ZREM', KEYS[1], ARGV[1])
keep_slots(KEYS[1], KEYS[2], ARGV[2])
return had
