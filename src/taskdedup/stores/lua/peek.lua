-- Is the enqueue lock held? If so, count the caller as one more duplicate, as acquire would.
-- Takes nothing when the key is free: the caller then enqueues by the usual acquire.
-- KEYS: lock   ARGV: record_duplicate (1/0)
-- Reply: nil when free, else one string "<state> <fence> <duplicates> <holder>", state as
-- acquire's (0, or p while the holder's publish is not confirmed: then nothing is counted).
local lock = redis.call('HMGET', KEYS[1], 'j', 'f', 'd', 'c', 's')
if not lock[1] then return false end
local dups = lock[3] or '0'
if lock[4] == '0' and lock[5] == 'q' then return 'p ' .. lock[2] .. ' ' .. dups .. ' ' .. lock[1] end
if ARGV[1] == '1' then  -- (no job id was made for it)
  dups = count_duplicate(KEYS[1], dups, '-', nil)
end
return '0 ' .. lock[2] .. ' ' .. dups .. ' ' .. lock[1]
