-- An operator frees a key whoever holds it (``taskdedup unlock``); noted in its history.
-- KEYS: lock, run.  Reply: 1 if anything was removed.
local holder = redis.call('HGET', KEYS[1], 'j') or redis.call('HGET', KEYS[2], 'j')
if not holder then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
remember_event(KEYS[1], 'unlocked', holder, 'operator')
return 1
