-- Helpers prepended to every taskdedup script. Times are the server's, in milliseconds.
if redis.replicate_commands then pcall(redis.replicate_commands) end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Integers as exact decimal strings (Lua would print large numbers in exponent form).
local function int(n)
  return string.format('%.0f', n)
end

-- A key's decision history (``taskdedup explain``), newest first: "<ms> <event> <job> ...",
-- at most 20 entries, kept a day after the last. It lives beside the lock, in its hash slot.
local function remember_event(lock_key, ...)
  local log_key = string.sub(lock_key, 1, #lock_key - 4) .. 'log'
  redis.call('LPUSH', log_key, table.concat({int(now_ms()), ...}, ' '))
  redis.call('LTRIM', log_key, 0, 19)
  redis.call('PEXPIRE', log_key, 86400000)
end

-- The next fencing token of a key: a counter seeded from the server clock in microseconds,
-- so tokens keep increasing even after the counter itself has expired.
local function next_fence(fence_key, ttl_ms)
  local fence
  local kind = redis.call('TYPE', fence_key)['ok']
  if kind == 'string' and tonumber(redis.call('GET', fence_key)) then
    fence = redis.call('INCR', fence_key)
  else  -- none yet, or garbled (not ours): seeded again from the clock, so it still rises
    if kind ~= 'none' then redis.call('DEL', fence_key) end
    local t = redis.call('TIME')
    local seed = t[1] .. string.format('%06d', tonumber(t[2]))
    redis.call('SET', fence_key, seed)
    fence = tonumber(seed)
  end
  redis.call('PEXPIRE', fence_key, ttl_ms + 86400000)
  return fence
end

-- Hand the enqueue lock to a new job id (reschedule_once); returns the kept payload or false.
local function hand_off(lock_key, fence_key, job, ttl_ms, grace_ms, now)
  local payload, task = unpack(redis.call('HMGET', lock_key, 'p', 't'))
  local fence = next_fence(fence_key, ttl_ms)
  redis.call('DEL', lock_key)
  local confirmed = '0'
  if grace_ms >= ttl_ms then confirmed = '1' end  -- no confirmation asked for
  redis.call('HSET', lock_key, 'j', job, 's', 'q', 'f', int(fence), 'd', '0',
    'e', int(now + ttl_ms), 'c', confirmed, 't', task or '', 'a', int(now))
  redis.call('PEXPIRE', lock_key, grace_ms)
  return payload
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
