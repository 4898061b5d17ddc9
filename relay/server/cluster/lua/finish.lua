-- A request of an API key ended: free its slot, release its reservation, charge its
-- tokens, all at once (the tokens replace what was reserved for them).
-- KEYS: slots, day, month, reserved.
-- ARGV: process, held (0/1), tokens, day ttl ms, month ttl ms, reserved tokens.
-- Returns 1 when this process's slot or reservation count went below zero (Redis lost
-- part of it: the process re-asserts what it holds), else 0.
local short = 0
local function give_back(key, amount)
  local left = redis.call('HINCRBY', key, ARGV[1], -amount)
  if left <= 0 then
    redis.call('HDEL', key, ARGV[1])
    if left < 0 then
      short = 1
    end
  end
end
if ARGV[2] == '1' then
  give_back(KEYS[1], 1)
end
local reserved = tonumber(ARGV[6])
if reserved > 0 then
  give_back(KEYS[4], reserved)
end
local tokens = tonumber(ARGV[3])
if tokens > 0 then
  redis.call('INCRBY', KEYS[2], tokens)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  redis.call('INCRBY', KEYS[3], tokens)
  redis.call('PEXPIRE', KEYS[3], ARGV[5])
end
return short
