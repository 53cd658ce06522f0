-- (none) -> QUEUED(job); QUEUED -> QUEUED with dups+1 and the latest payload kept.
-- The holder acquiring again (a hand-off being published) changes nothing.
-- KEYS: lock [, list]   ARGV: job, ttl_ms, grace_ms, record_duplicate (1/0), task,
--   debounce_ms, wait_ms (debounce: the run is due debounce_ms after the latest submission,
--   at most wait_ms after the first; 0 0 otherwise), cancel (1: a duplicate of a running
--   holder asks it to stop, 'x': supersede with running="cancel")
--   [, payload (reschedule_once, supersede, debounce: the latest duplicate's arguments)]
--   [, message (with a list)]
-- With a list (the broker's queue, on this same server) the job's message is pushed there when
-- the lock is ours, in the same atomic step: lock and message appear together or not at all.
-- The push is the first write, so if it fails (a key of the wrong type) nothing is written.
-- Reply: one string "<state> <fence> <duplicates> <holder>" (cheaper to read than an array);
-- state 1 = ours, 0 = another job's, p = another job's whose publish is not confirmed yet (it
-- may still fail and free the key: the caller asks again rather than answer with it), r =
-- another job's that runs (what a supersede duplicate did depends on it).
-- With a guard (stores/base.py Guard; the variant with guard.lua before this, which takes the
-- guard's key and arguments off the ends and names them GUARD...): a lock that is another
-- job's is answered by the guard, "g <its pttl or value>", or, when the guard is free,
-- "s 0 0 <holder>" (nothing written either way); a free lock takes the guard with SET NX
-- first and, when it is another's, answers "g ..." having written nothing.
-- Cost (counted by tests/test_store_work.py): a new key is HMGET, TIME, HSET, PEXPIRE; a
-- duplicate is HMGET and HSET (its second also checks the ttl; a debounced one reads TIME; one
-- that owes a run after a running holder also writes the holder's job record). A guard adds a
-- SET to a new key; a duplicate it answers is HMGET and PTTL or GET.
local n = #ARGV
local message
if KEYS[2] then message = ARGV[n]; n = n - 1 end
local payload = ARGV[9]
if n < 9 then payload = nil end
local debounce = tonumber(ARGV[6])
local lock = redis.call('HMGET', KEYS[1], 'j', 'f', 'd', 's', 'c', 'e', 'w')
if lock[1] == ARGV[1] then
  -- The holder publishing again: a hand-off's first publish, or a deferred copy of a running
  -- job, is pushed; the same queued publish repeated (a retried call whose reply was lost) is
  -- not, as its message is already in the list ('m').
  if KEYS[2] and not (lock[4] == 'q' and redis.call('HGET', KEYS[1], 'm') == '1') then
    redis.call('LPUSH', KEYS[2], message)
    redis.call('HSET', KEYS[1], 'm', '1')
    if lock[4] == 'q' and lock[5] == '0' then  -- a hand-off being published: now confirmed
      local left = tonumber(lock[6]) - now_ms()
      if left > 0 then
        redis.call('HSET', KEYS[1], 'c', '1')
        redis.call('PEXPIRE', KEYS[1], left)
      end
    end
  end
  return '1 ' .. lock[2] .. ' ' .. lock[3] .. ' ' .. lock[1]
end
if GUARD then
  local held
  if lock[1] then  -- another job's lock: the guard's holder answers, if it still has one
    if GUARD_ANSWER == 'ttl' then
      held = redis.call('PTTL', GUARD)
      if held == -2 then held = false end
    else
      held = redis.call('GET', GUARD)
    end
    if held then return 'g ' .. held end
    return 's 0 0 ' .. lock[1]
  end
  if GUARD_TTL == '' then
    held = not redis.call('SET', GUARD, GUARD_VALUE, 'NX')
  else
    held = not redis.call('SET', GUARD, GUARD_VALUE, 'NX', 'PX', GUARD_TTL)
  end
  if held then
    if GUARD_ANSWER == 'ttl' then return 'g ' .. redis.call('PTTL', GUARD) end
    return 'g ' .. redis.call('GET', GUARD)
  end
end
if lock[1] then
  local dups = lock[3] or '0'
  local counted = ARGV[4] == '1'
  local also = {}  -- what else this duplicate changes on the lock
  if debounce > 0 and lock[4] == 'q' and lock[7] then  -- the burst's run moves
    also = {'u', int(math.min(now_ms() + debounce, tonumber(lock[7])))}
  elseif ARGV[8] == '1' and lock[4] == 'r' then  -- the running holder is asked to stop
    also = {'x', '1'}
  end
  if counted then dups = count_duplicate(KEYS[1], dups, ARGV[1], payload, also) end
  if counted and payload and lock[4] == 'r' then
    -- a run owed after a running holder (reschedule_once, supersede) is kept on the holder's
    -- job record too: the lock lives only a lease past its worker's death, the record longer,
    -- so a copy that takes the run over still owes it (claim.lua). Only into a record that
    -- exists (the claim writes it with the lock, and it outlives the lock): one written here
    -- would have no expiry (G9).
    local record = string.sub(KEYS[1], 1, #KEYS[1] - 4) .. 'job:' .. lock[1]
    if redis.call('EXISTS', record) == 1 then
      redis.call('HSET', record, 'od', dups, 'op', payload, 'ol', ARGV[1])
    end
  end
  -- a lock without a ttl (not one we wrote: every lock we write expires, G9; a restore without
  -- ttls, a hand edit) would hold its key for good: it gets this call's ttl. Checked at a
  -- holder's second duplicate and every 64th after (and at each uncounted one: dry runs), so
  -- a duplicate, the first included, stays two commands.
  if not counted or tonumber(dups) % 64 == 2 then
    if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  end
  local state = '0'
  if lock[4] == 'q' and lock[5] == '0' then state = 'p' elseif lock[4] == 'r' then state = 'r' end
  return state .. ' ' .. lock[2] .. ' ' .. dups .. ' ' .. lock[1]
end
if KEYS[2] then redis.call('LPUSH', KEYS[2], message) end
local ttl, grace = tonumber(ARGV[2]), tonumber(ARGV[3])
local fence = int(next_fence(false))
local confirmed = '0'
if grace >= ttl or KEYS[2] then confirmed = '1'; grace = ttl end
local now = now_ms()  -- 't' and 'a': the task and since when, for the tools
local fields = {'j', ARGV[1], 's', 'q', 'f', fence, 'd', '0', 'e', int(now + ttl),
  'c', confirmed, 't', ARGV[5], 'a', int(now)}
if KEYS[2] then fields[#fields + 1] = 'm'; fields[#fields + 1] = '1' end  -- (pushed with it)
if debounce > 0 then  -- 'u': when the run is due; 'w': the latest it may be moved to
  for _, v in ipairs({'u', int(now + debounce), 'w', int(now + tonumber(ARGV[7]))}) do
    fields[#fields + 1] = v
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], grace)
return '1 ' .. fence .. ' 0 ' .. ARGV[1]
