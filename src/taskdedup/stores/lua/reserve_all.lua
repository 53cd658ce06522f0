-- Take a slot of every scope for one member, all or none (stacked caps: a global cap and a
-- per-tenant one, say). A member holding a slot of a scope keeps it.
-- KEYS: slots1, scope1, slots2, scope2, ...   ARGV: member, ttl_ms, then limit, name per scope
-- Reply: the index (0-based) of the first full scope, or -1 when every slot was taken.
local now = now_ms()
local member, ttl = ARGV[1], tonumber(ARGV[2])
local parts = #KEYS / 2
for i = 1, parts do
  local slots = KEYS[2 * i - 1]
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)
  if not redis.call('ZSCORE', slots, member)
    and redis.call('ZCARD', slots) >= tonumber(ARGV[1 + 2 * i]) then
    return i - 1
  end
end
for i = 1, parts do
  redis.call('ZADD', KEYS[2 * i - 1], int(now + ttl), member)
  keep_slots(KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 + 2 * i])
end
return -1
