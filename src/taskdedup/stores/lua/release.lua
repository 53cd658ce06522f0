-- Owner-checked release of the enqueue lock and the run lock.
-- KEYS: lock, run   ARGV: job
return release_if_holder(KEYS[1], ARGV[1]) + release_if_holder(KEYS[2], ARGV[1])
