-- A process's heartbeat for the limits. Needs now.lua.
-- KEYS: live, then the per-key hashes (slots:<key id>, reserved:<key id>) in which this
-- process's count is re-asserted. ARGV: process, lease ms, forget ms, then that count
-- for each of those hashes (0: no field).
-- Returns 1 when this process's lease was gone (Redis restarted, flushed or evicted it,
-- or the process stalled past it).
local lost = 1
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if lease and tonumber(lease) >= now then
  lost = 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
for i = 2, #KEYS do
  local count = tonumber(ARGV[i + 2])
  if count > 0 then
    redis.call('HSET', KEYS[i], ARGV[1], count)
    redis.call('PEXPIRE', KEYS[i], 86400000)
  else
    redis.call('HDEL', KEYS[i], ARGV[1])
  end
end
return lost
