-- Re-assert how many concurrency slots one process holds for a key (0: none), with the
-- hash's expiry in the same step (as admit.lua gives it).
-- KEYS: slots. ARGV: process, count, ttl ms.
if tonumber(ARGV[2]) > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
