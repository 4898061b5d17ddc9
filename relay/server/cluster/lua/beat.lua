-- A process's heartbeat for the limits. Needs now.lua.
-- KEYS: live. ARGV: process, lease ms, forget ms. Returns 1 when this process's lease
-- was gone (Redis restarted, flushed or evicted it, or the process stalled past it).
local lost = 1
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if lease and tonumber(lease) >= now then
  lost = 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return lost
