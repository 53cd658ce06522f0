-- Is the enqueue lock held? If so, count the caller as one more duplicate, as acquire would.
-- Takes nothing when the key is free: the caller then enqueues by the usual acquire.
-- KEYS: lock   ARGV: record_duplicate (1/0)
-- Reply: nil when free, else one string "<fence> <duplicates> <holder>".
local lock = redis.call('HMGET', KEYS[1], 'j', 'f', 'd')
if not lock[1] then return false end
local dups = lock[3]
if ARGV[1] == '1' then dups = redis.call('HINCRBY', KEYS[1], 'd', 1) end
return lock[2] .. ' ' .. dups .. ' ' .. lock[1]
