-- Owner-checked release of the enqueue lock and the run lock.
-- KEYS: lock, run   ARGV: job, queued_only (1: only an enqueue lock still QUEUED, no run lock)
if ARGV[2] == '1' then
  if redis.call('HGET', KEYS[1], 's') ~= 'q' then return 0 end
  return release_if_holder(KEYS[1], ARGV[1])
end
return release_if_holder(KEYS[1], ARGV[1]) + release_if_holder(KEYS[2], ARGV[1])
