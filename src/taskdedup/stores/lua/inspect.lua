-- What holds a key now: the lock's fields and remaining life, the run lock's holder, and what
-- the tools show (task, since when, and the holder's worker and attempts from its job record,
-- which shares the key's hash slot: ``<prefix>:{key}:job:<job id>``).
-- KEYS: lock, run
local lock = redis.call('HMGET', KEYS[1], 'j', 's', 'f', 'd', 'c', 't', 'a', 'l', 'u', 'x')
local run = redis.call('HMGET', KEYS[2], 'j', 't', 'a')
local holder = lock[1] or run[1]
local rec = {false, false, false}
if holder then
  local base = string.sub(KEYS[1], 1, #KEYS[1] - 4)  -- drop 'lock'
  rec = redis.call('HMGET', base .. 'job:' .. holder, 'o', 'a', 'b')
end
return {lock[1], lock[2], lock[3], lock[4], lock[5], redis.call('PTTL', KEYS[1]),
  run[1], redis.call('PTTL', KEYS[2]), lock[6] or run[2], lock[7] or run[3], rec[1], rec[2],
  rec[3], lock[8], lock[9], lock[10]}
