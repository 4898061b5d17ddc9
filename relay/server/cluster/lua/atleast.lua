-- Raise token counters to at least what the request log says was spent, never lower one:
-- after Redis lost writes (a restart, a flush, a failover to a replica that had not got
-- the last ones). Each counter keeps an expiry, set in the same step.
-- KEYS: counters. ARGV: for each counter, the value and its TTL in ms.
for i, key in ipairs(KEYS) do
  local value = tonumber(ARGV[2 * i - 1])
  if tonumber(redis.call('GET', key) or '0') < value then
    redis.call('SET', key, value, 'PX', ARGV[2 * i])
  end
end
return 1
