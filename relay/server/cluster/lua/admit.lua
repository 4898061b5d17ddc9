-- Admit one request of an API key under its limits (SPEC §13). Needs now.lua.
-- KEYS: live, slots, rate, day, month, reserved.
-- ARGV: process, lease ms, max_concurrent, requests/min, tokens/day, tokens/month (0: none),
-- tokens to reserve against the budgets.
-- Returns {0, 0} when admitted, else {refusal (1 month, 2 day, 3 rate, 4 slots), retry ms}.
-- Concurrency slots and reserved tokens are counted per process (hash fields): those of
-- a process whose lease ran out do not count, and the field of one gone from live is
-- deleted.
local function held(key)
  local fields = redis.call('HGETALL', key)
  local total = 0
  for i = 1, #fields, 2 do
    local lease = redis.call('ZSCORE', KEYS[1], fields[i])
    if not lease then
      redis.call('HDEL', key, fields[i])
    elseif tonumber(lease) >= now then
      total = total + tonumber(fields[i + 1])
    end
  end
  return total
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if redis.call('PTTL', KEYS[1]) < 0 then
  redis.call('PEXPIRE', KEYS[1], 3600000)  -- (as beat.lua keeps it: never without an expiry)
end
local day_limit = tonumber(ARGV[5])
local month_limit = tonumber(ARGV[6])
local budgeted = day_limit > 0 or month_limit > 0
-- What requests in flight may still cost counts as spent already.
local reserved = 0
if budgeted then
  reserved = held(KEYS[6])
end
if month_limit > 0 and tonumber(redis.call('GET', KEYS[5]) or '0') + reserved >= month_limit then
  return {1, 0}
end
if day_limit > 0 and tonumber(redis.call('GET', KEYS[4]) or '0') + reserved >= day_limit then
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
  if held(KEYS[2]) >= most then
    return {4, 0}
  end
  redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
  redis.call('PEXPIRE', KEYS[2], 86400000)
end
if rate > 0 then
  redis.call('SET', KEYS[3], string.format('%.3f', tat + interval), 'PX', 120000)
end
local reserve = tonumber(ARGV[7])
if budgeted and reserve > 0 then
  redis.call('HINCRBY', KEYS[6], ARGV[1], reserve)
  redis.call('PEXPIRE', KEYS[6], 86400000)
end
return {0, 0}
