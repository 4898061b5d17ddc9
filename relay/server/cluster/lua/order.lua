-- Record an order (a drain, a refresh) for one process, which reads its orders back every
-- second; the record expires with the hash's TTL, set in the same step.
-- KEYS: the process's orders. ARGV: order id, the message (JSON), TTL ms.
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
