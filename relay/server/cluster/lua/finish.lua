-- A request of an API key ended: free its slot, charge its tokens.
-- KEYS: slots, day, month. ARGV: process, held (0/1), tokens, day ttl ms, month ttl ms.
if ARGV[2] == '1' then
  local left = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
  if left <= 0 then
    redis.call('HDEL', KEYS[1], ARGV[1])
  end
end
local tokens = tonumber(ARGV[3])
if tokens > 0 then
  redis.call('INCRBY', KEYS[2], tokens)
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
  redis.call('INCRBY', KEYS[3], tokens)
  redis.call('PEXPIRE', KEYS[3], ARGV[5])
end
return 0
