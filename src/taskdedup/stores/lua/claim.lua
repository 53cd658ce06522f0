-- A worker starts a job: answers run / running / done / busy / exhausted / early (debounce:
-- its run is not due yet; the reply's 8th item says in how many ms).
-- busy: the run lock, or (hold mode) the enqueue lock, is another job's.
-- KEYS: lock, run, job record
-- ARGV: job, owner, lease_ms, ttl_ms, lock mode (release|hold|none), run_lock (1/0),
--       memory_ms, attempt ('' = unknown), max_attempts (0 = none), handoff job ('' = none),
--       grace_ms, nonce (this claim's id), lost claims (comma-separated nonces of this job's
--       claims whose replies never arrived: a record they wrote is no run of the job), task,
--       latest (1: run with the latest duplicate's arguments, the reply's 7th item)
-- A run is not written to the key's history (the job's record says who runs it and which
-- attempt): only a delivery that waits, is dropped or has run out of attempts is.
local function decide()
local job, owner = ARGV[1], ARGV[2]
local lease, ttl, memory = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[7])
local now = now_ms()
local rec = redis.call('HMGET', KEYS[3], 's', 'o', 'u', 'a', 'n', 'f', 'k', 'c', 'w', 'p', 'od',
  'op', 'ol')
local attempts = 1
if rec[1] then
  if rec[1] == 'd' then  -- a finished job holds nothing: free what a late re-send took
    release_if_holder(KEYS[1], job)
    release_if_holder(KEYS[2], job)
    return {'done', rec[6], rec[4], rec[2]}
  end
  attempts = tonumber(rec[4]) + 1
  if rec[1] == 'q' and ARGV[8] ~= '' and rec[5] and rec[5] ~= '' and
      tonumber(ARGV[8]) <= tonumber(rec[5]) then
    -- a copy of an attempt that already ended asking for a retry (the broker delivered it
    -- again while it ran). The retry is the job's next run: the copy waits while the retry
    -- may still be sent (unconfirmed, within the grace) or, sent, may still come (its delay
    -- plus the grace). Past that the retry never went out, or the broker lost it: the copy
    -- runs in its stead, and the retry, should it come, waits for that run (below).
    local confirmed = rec[8] ~= '0'
    local wait = tonumber((confirmed and rec[9] or rec[3]) or 0)
    if wait > now then return {'running', rec[6], rec[4], rec[2]} end
  end
  if rec[1] == 'r' then
    -- a live run holds the job, whatever this delivery's attempt number: a later attempt
    -- (its retry reached the broker, not the store) waits for it, never runs beside it (G12)
    local newer = ARGV[8] ~= '' and rec[5] and rec[5] ~= '' and tonumber(ARGV[8]) > tonumber(rec[5])
    local lost = rec[7] and rec[7] ~= '' and ARGV[13] and
      string.find(',' .. ARGV[13] .. ',', ',' .. rec[7] .. ',', 1, true)
    if lost then attempts = attempts - 1 end  -- that claim's run never started: no attempt
    if tonumber(rec[3]) > now and not lost then
      return {'running', rec[6], rec[4], rec[2]}
    end
    local most = tonumber(ARGV[9])
    if not newer and most > 0 and attempts > most then
      redis.call('HSET', KEYS[3], 's', 'd')
      redis.call('PEXPIRE', KEYS[3], memory)
      release_if_holder(KEYS[1], job)
      release_if_holder(KEYS[2], job)
      return {'exhausted', rec[6], rec[4], rec[2]}
    end
  end
end
local lock = redis.call('HMGET', KEYS[1], 'j', 'f', 'd', 's', 'l', 'u', 'p')
if lock[1] == job and lock[6] and lock[4] == 'q' then
  -- debounce: a later submission moved the run ('u'); this delivery comes back when it is due
  local wait = tonumber(lock[6]) - now
  if wait > 0 then return {'early', '0', int(attempts - 1), job, '', false, false, int(wait)} end
end
if ARGV[6] == '1' then
  local running = redis.call('HGET', KEYS[2], 'j')
  if running and running ~= job then return {'busy', '0', int(attempts - 1), running} end
end
local fence = false
if ARGV[5] == 'hold' and lock[1] and lock[1] ~= job then
  -- the key is another job's: this copy is stale or was sent without a lock (G12)
  if lock[4] == 'r' then  -- that job runs: wait for it to end rather than run beside it
    return {'busy', '0', int(attempts - 1), lock[1]}
  end
  if lock[4] == 'q' then  -- that job waits in the queue (and may never come): run first;
    fence = int(next_fence(lock[2]))  -- it will wait for this one when it starts
    if ARGV[15] == '1' then
      -- supersede: the arguments kept for that job stay its own (in its record, which its
      -- run takes them from), and this run holds the lock owing nothing for it
      if lock[7] then
        local displaced = string.sub(KEYS[1], 1, #KEYS[1] - 4) .. 'job:' .. lock[1]
        redis.call('HSET', displaced, 'p', lock[7])
        redis.call('PEXPIRE', displaced, ttl)
      end
      redis.call('HDEL', KEYS[1], 'p', 'l')
      redis.call('HSET', KEYS[1], 'd', '0')
    end
    redis.call('HSET', KEYS[1], 'j', job, 's', 'r', 'f', fence, 'c', '1')
    redis.call('PEXPIRE', KEYS[1], lease)
  end
end
local handoff, payload = '', false
-- ARGV[15] (debounce, supersede): the run takes the latest duplicate's arguments ('p')
local latest = false
if lock[1] == job and ARGV[15] == '1' then latest = lock[7] or false end
-- a run taken over (its worker died) runs what the run before it ran: its record keeps them,
-- or, supersede, the newest a submission made while it ran left there (acquire.lua)
if ARGV[15] == '1' and not latest and rec[1] == 'r' and rec[11] and lock[1] ~= job then
  latest = rec[12]
  redis.call('HDEL', KEYS[3], 'od', 'op', 'ol')
end
if ARGV[15] == '1' and not latest then latest = rec[10] or false end
if lock[1] == job then
  fence = lock[2]
  if ARGV[5] == 'hold' and latest then  -- supersede: the duplicates so far are consumed; one
    note_duplicates(KEYS[1], job, lock[3], lock[5], 'superseded')  -- while it runs owes a
    -- run of its own
    redis.call('HDEL', KEYS[1], 'p', 'l')
    redis.call('HSET', KEYS[1], 's', 'r', 'c', '1', 'd', '0')
    redis.call('PEXPIRE', KEYS[1], lease)
  elseif ARGV[5] == 'hold' then
    redis.call('HSET', KEYS[1], 's', 'r', 'c', '1')  -- it was published: it runs
    redis.call('PEXPIRE', KEYS[1], lease)
  elseif ARGV[5] == 'release' then
    note_duplicates(KEYS[1], job, lock[3], lock[5], lock[6] and 'debounced' or nil)
    if tonumber(lock[3]) > 0 and ARGV[10] ~= '' then
      handoff = ARGV[10]
      payload = hand_off(KEYS[1], handoff, ttl, tonumber(ARGV[11]))
    else
      redis.call('DEL', KEYS[1])
    end
  end
elseif not lock[1] and ARGV[5] == 'hold' then
  fence = int(next_fence(false))
  redis.call('HSET', KEYS[1], 'j', job, 's', 'r', 'f', fence, 'd', '0',
    'e', int(now + ttl), 'c', '1', 't', ARGV[14] or '', 'a', int(now))
  redis.call('PEXPIRE', KEYS[1], lease)
  if rec[1] == 'r' and rec[11] and ARGV[15] ~= '1' then
    -- a run taken over whose lock lapsed with its worker: the run it owed to submissions made
    -- while it ran is not lost (its record kept it, acquire.lua): reschedule_once still owes
    -- it, after this run (supersede took their newest arguments above)
    redis.call('HSET', KEYS[1], 'd', rec[11], 'p', rec[12], 'l', rec[13])
  end
end
-- a run lock is an acquisition of its own: its token orders the runs, not the enqueues (G3)
if not fence or ARGV[6] == '1' then fence = int(next_fence(fence or lock[2])) end
local run_lock = '0'
if ARGV[6] == '1' then
  run_lock = '1'
  redis.call('HSET', KEYS[2], 'j', job, 'o', owner, 't', ARGV[14] or '', 'a', int(now))
  redis.call('PEXPIRE', KEYS[2], lease)
end
-- 'l': this run holds the run lock (so finish looks there only then); 'b': when it began
local fields = {'s', 'r', 'o', owner, 'u', int(now + lease), 'a', int(attempts),
  'n', ARGV[8], 'f', fence, 'm', ARGV[7], 'k', ARGV[12] or '', 'l', run_lock, 'b', int(now)}
if latest then fields[#fields + 1] = 'p'; fields[#fields + 1] = latest end
redis.call('HSET', KEYS[3], unpack(fields))
redis.call('PEXPIRE', KEYS[3], lease + memory)
return {'run', fence, int(attempts), owner, handoff, payload, latest}
end
local reply = decide()
if reply[1] == 'run' or reply[1] == 'early' then return reply end  -- (ordinary: no history)
if reply[1] == 'done' then
  remember_event(KEYS[1], 'copy_dropped', ARGV[1])
elseif reply[1] == 'exhausted' then
  remember_event(KEYS[1], 'exhausted', ARGV[1], reply[3])
else  -- busy, or running elsewhere: the delivery waits and is sent again
  remember_event(KEYS[1], 'waited', ARGV[1], reply[4])
end
return reply
