-- Admit one request of an API key under its limits (SPEC §13). Needs now.lua.
-- KEYS: live, slots, rate, day, month.
-- ARGV: process, lease ms, max_concurrent, requests/min, tokens/day, tokens/month (0: none).
-- Returns {0, 0} when admitted, else {refusal (1 month, 2 day, 3 rate, 4 slots), retry ms}.
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then
  redis.call('PEXPIRE', KEYS[1], 3600000)  -- (as beat.lua keeps it: never without an expiry)
end
local month_limit = tonumber(ARGV[6])
if month_limit > 0 and tonumber(redis.call('GET', KEYS[5]) or '0') >= month_limit then
  return {1, 0}
end
local day_limit = tonumber(ARGV[5])
if day_limit > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') >= day_limit then
  return {2, 0}
end
local rate = tonumber(ARGV[4])
local tat = 0
local interval = 0
if rate > 0 then
  interval = 60000 / rate
  local slack = 60000 - interval
  tat = tonumber(redis.call('GET', KEYS[3]) or '0')
  if tat < now then tat = now end
  if tat - now > slack + 0.001 then
    return {3, math.ceil(tat - slack - now)}
  end
end
local most = tonumber(ARGV[3])
if most > 0 then
  local held = redis.call('HGETALL', KEYS[2])
  local total = 0
  for i = 1, #held, 2 do
    local lease = redis.call('ZSCORE', KEYS[1], held[i])
    if not lease then
      redis.call('HDEL', KEYS[2], held[i])
    elseif tonumber(lease) >= now then
      total = total + tonumber(held[i + 1])
    end
  end
  if total >= most then
    return {4, 0}
  end
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[2], 86400000)
end
if rate > 0 then
  redis.call('SET', KEYS[3], string.format('%.3f', tat + interval), 'PX', 120000)
end
return {0, 0}
