-- Put before acquire.lua for an Acquire with a guard (stores/base.py Guard): the guard is the
-- last key, and the last three arguments are its value, its ttl in ms ('' for none) and what a
-- holder's answer is ('ttl': its PTTL, 'value': its value). They are named here and taken off
-- KEYS and ARGV, so acquire.lua reads its own keys and arguments where it always does.
local GUARD, GUARD_VALUE, GUARD_TTL, GUARD_ANSWER =
  KEYS[#KEYS], ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV]
local KEYS = {unpack(KEYS, 1, #KEYS - 1)}
local ARGV = {unpack(ARGV, 1, #ARGV - 3)}
