-- What holds a key now: the lock's fields and remaining life, and the run lock's holder.
-- KEYS: lock, run
local lock = redis.call('HMGET', KEYS[1], 'j', 's', 'f', 'd', 'c')
return {lock[1], lock[2], lock[3], lock[4], lock[5], redis.call('PTTL', KEYS[1]),
  redis.call('HGET', KEYS[2], 'j'), redis.call('PTTL', KEYS[2])}
