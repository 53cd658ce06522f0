-- Helpers prepended to every taskdedup script. Times are the server's, in milliseconds.
-- HISTORY (set above this file by the store: true, or false with the history setting off)
-- says whether scripts write a key's decision history at all.

if redis.replicate_commands then pcall(redis.replicate_commands) end

-- The server clock, read once per script: TIME costs a command, and one script is one instant.
local clock_us
local function now_us()
  if not clock_us then
    local t = redis.call('TIME')
    clock_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  return clock_us
end

local function now_ms()
  return math.floor(now_us() / 1000)
end

-- Integers as exact decimal strings (Lua would print large numbers in exponent form).
local function int(n)
  return string.format('%.0f', n)
end

-- A key's decision history (``taskdedup explain``), newest first: "<ms> <event> <job> ...",
-- at most 20 entries, kept a day after the last. It lives beside the lock, in its hash slot.
-- Only what a person asks about is written here (a duplicate, a wait, a dropped copy, a retry,
-- a lock freed or handed on): the ordinary life of a job (accepted, started, released) is read
-- from the lock and the job's record instead, so it costs the hot path nothing.
local function remember_event(lock_key, ...)
  if not HISTORY then return end
  local log_key = string.sub(lock_key, 1, #lock_key - 4) .. 'log'
  if redis.call('LPUSH', log_key, table.concat({int(now_ms()), ...}, ' ')) > 20 then
    redis.call('LTRIM', log_key, 0, 19)  -- (only once it is longer: a command saved)
  end
  redis.call('PEXPIRE', log_key, 86400000)
end

-- The next fencing token of a key: the server clock in microseconds, past ``last`` (the token
-- the key's lock holds now, if any). No counter key: a token taken later is larger as long as
-- the server clock does not step back, and never below the live lock's own.
local issued  -- the token this script gave last: two acquisitions in one script differ too
local function next_fence(last)
  local fence = now_us()
  if last and tonumber(last) and tonumber(last) >= fence then fence = tonumber(last) + 1 end
  if issued and issued >= fence then fence = issued + 1 end
  issued = fence
  return fence
end

-- Hand the enqueue lock to a new job id (reschedule_once); returns the kept payload or false.
-- 'h' marks a handed-off lock: its history names it (rescheduled to), so a failed publish of
-- it is written as freed.
local function hand_off(lock_key, job, ttl_ms, grace_ms)
  local old = redis.call('HMGET', lock_key, 'p', 't', 'f')
  local fence = next_fence(old[3])
  local now = now_ms()
  redis.call('DEL', lock_key)
  local confirmed = '0'
  if grace_ms >= ttl_ms then confirmed = '1' end  -- no confirmation asked for
  redis.call('HSET', lock_key, 'j', job, 's', 'q', 'f', int(fence), 'd', '0',
    'e', int(now + ttl_ms), 'c', confirmed, 't', old[2] or '', 'a', int(now), 'h', '1')
  redis.call('PEXPIRE', lock_key, grace_ms)
  return old[1]
end

-- One more duplicate of the holder of ``lock_key`` (its count ``dups`` so far): counted on the
-- lock with the latest duplicate's id ('l': ``job``, '-' when none was made) and payload
-- (reschedule_once). That is all a duplicate writes: the key's history gets one line for all
-- of a holder's duplicates when its lock ends (note_duplicates), not one per holder at its
-- first duplicate (that was four more commands on the duplicate a double click makes).
-- ``also``: more fields it sets (debounce: when the run is due; cancel: the stop request).
local function count_duplicate(lock_key, dups, job, payload, also)
  local count = tostring(tonumber(dups) + 1)
  local fields = {'d', count, 'l', job}
  if payload then fields[5] = 'p'; fields[6] = payload end
  for _, v in ipairs(also or {}) do fields[#fields + 1] = v end
  redis.call('HSET', lock_key, unpack(fields))
  return count
end

-- The duplicates a holder's lock answered, written once to the key's history as the lock ends
-- (freed at the start of its run, at its end, by a release or an operator, or handed on):
-- "<ms> <what> <last duplicate> <holder> <count>". Nothing when it answered none. ``what`` is
-- 'deduplicated', or what the duplicates did: 'debounced' (folded into a burst's one run),
-- 'superseded' (their arguments replaced the queued holder's), 'cancel_requested' (they asked
-- the running holder to stop).
local function note_duplicates(lock_key, holder, dups, last, what)
  if dups and dups ~= '0' then
    remember_event(lock_key, what or 'deduplicated', last or '-', holder, dups)
  end
end

local function release_if_holder(key, job)
  if redis.call('HGET', key, 'j') == job then
    redis.call('DEL', key)
    return 1
  end
  return 0
end

-- A reservation scope's records live until its last slot expires (or go with the last slot).
-- KEYS of the caller: slots (sorted set member -> expiry ms), scope (the scope's name).
local function keep_slots(slots_key, scope_key, scope)
  local last = redis.call('ZRANGE', slots_key, -1, -1, 'WITHSCORES')
  if #last == 0 then
    redis.call('DEL', slots_key, scope_key)
    return
  end
  local at = int(tonumber(last[2]))
  redis.call('PEXPIREAT', slots_key, at)
  redis.call('SET', scope_key, scope)
  redis.call('PEXPIREAT', scope_key, at)
end
