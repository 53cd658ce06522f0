-- An operator frees a key whoever holds it (``taskdedup unlock``); noted in its history.
-- KEYS: lock, run.  Reply: 1 if anything was removed.
local lock = redis.call('HMGET', KEYS[1], 'j', 'd', 'l')
local holder = lock[1] or redis.call('HGET', KEYS[2], 'j')
if not holder then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
if lock[1] then note_duplicates(KEYS[1], holder, lock[2], lock[3]) end
remember_event(KEYS[1], 'unlocked', holder, 'operator')
return 1
