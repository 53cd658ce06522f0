-- Free a member's slot. 1 if it held one.
-- KEYS: slots, scope   ARGV: member, scope name
local had = redis.call('ZREM', KEYS[1], ARGV[1])
if had == 1 then keep_slots(KEYS[1], KEYS[2], ARGV[2]) end
return had
