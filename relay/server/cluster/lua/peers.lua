-- The processes whose limits lease runs now (each process's share of a key's limits while
-- Redis cannot be reached is taken among them). Needs now.lua.
-- KEYS: live.
return redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf')
