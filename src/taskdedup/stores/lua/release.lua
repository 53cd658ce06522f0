-- Owner-checked release of the enqueue lock and the run lock.
-- KEYS: lock, run, fence   ARGV: job, queued_only (1: only an enqueue lock still QUEUED, no
-- run lock), why (for the key's history: publish_failed, discarded, ...). A lock whose
-- publish was never confirmed takes its fence counter and its 'accepted' entry with it: no
-- run used its token, and a counter seeded again from the clock still rises (a failed publish
-- leaves nothing behind).
local unpublished = false  -- a lock never confirmed: its job was never published
local function release()
  if ARGV[2] == '1' then
    if redis.call('HGET', KEYS[1], 's') ~= 'q' then return 0 end
    return release_if_holder(KEYS[1], ARGV[1])
  end
  local unconfirmed = redis.call('HGET', KEYS[1], 'c') == '0'
  local released = release_if_holder(KEYS[1], ARGV[1])
  if released == 1 and unconfirmed and KEYS[3] then
    redis.call('DEL', KEYS[3])
    unpublished = true
  end
  return released + release_if_holder(KEYS[2], ARGV[1])
end
local released = release()
local log_key = string.sub(KEYS[1], 1, #KEYS[1] - 4) .. 'log'
local last = redis.call('LINDEX', log_key, 0)
if unpublished and last and string.find(last, ' accepted ' .. ARGV[1] .. ' ', 1, true) then
  redis.call('LPOP', log_key)  -- its only trace: a failed publish leaves nothing behind
elseif released > 0 then
  remember_event(KEYS[1], 'freed', ARGV[1], ARGV[3] or '')
end
return released
