-- The live slots of a scope: {member, ms left, member, ms left, ...}, soonest first.
-- KEYS: slots
local now = now_ms()
local raw = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. int(now), '+inf', 'WITHSCORES')
local out = {}
for i = 1, #raw, 2 do
  out[#out + 1] = raw[i]
  out[#out + 1] = int(tonumber(raw[i + 1]) - now)
end
return out
