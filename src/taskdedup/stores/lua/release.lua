-- Owner-checked release of the enqueue lock and the run lock.
-- KEYS: lock, run   ARGV: job, queued_only (1: only an enqueue lock still QUEUED, no run
-- lock), why (for the key's history: publish_failed, discarded, ...). A lock whose publish
-- was never confirmed leaves no history: its job was never published, and a failed publish
-- leaves nothing behind.
local unpublished = false  -- a lock never confirmed: its job was never published
local answered = {}  -- the duplicates the lock answered: how many, the last
local function release()
  if ARGV[2] == '1' then
    if redis.call('HGET', KEYS[1], 's') ~= 'q' then return 0 end
    return release_if_holder(KEYS[1], ARGV[1])
  end
  -- unconfirmed, no retry ('y'), no hand-off ('h'), no duplicate counted: no history entry
  -- names it
  local lock = redis.call('HMGET', KEYS[1], 'c', 'y', 'd', 'h', 'l')
  local released = release_if_holder(KEYS[1], ARGV[1])
  if released == 1 then answered = {lock[3], lock[5]} end
  if released == 1 and lock[1] == '0' and not lock[2] and (lock[3] or '0') == '0'
      and not lock[4] then
    unpublished = true
  end
  return released + release_if_holder(KEYS[2], ARGV[1])
end
local released = release()
if released > 0 and not unpublished then
  note_duplicates(KEYS[1], ARGV[1], answered[1], answered[2])
  remember_event(KEYS[1], 'freed', ARGV[1], ARGV[3] or '')
end
return released
