-- What a job's record says: running under a live lease, waiting for its retry, finished, or
-- nothing (no record, or a run whose lease lapsed: its worker died).
-- KEYS: job record
local r = redis.call('HMGET', KEYS[1], 's', 'u')
if r[1] == 'd' then return 'finished' end
if r[1] == 'q' then return 'queued' end
if r[1] == 'r' and r[2] and tonumber(r[2]) > now_ms() then return 'running' end
return 'none'
