-- One submission of a paced scope: when it may start, in ms from now (GCRA, delaying rather
-- than refusing). The scope's record is its theoretical arrival time (TAT): when the next
-- submission would start if no burst were allowed. burst submissions start at once, then one
-- every interval; each call takes the next free start, so concurrent callers are spaced out
-- in the order the store saw them.
-- KEYS: pace   ARGV: interval_ms, burst
-- Cost: TIME, GET, SET (the record expires when it no longer holds anything back).
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local now = now_ms()
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local start = math.max(now, tat - (burst - 1) * interval)
local next_tat = tat + interval
redis.call('SET', KEYS[1], int(next_tat), 'PX', int(next_tat - now))
return int(start - now)
