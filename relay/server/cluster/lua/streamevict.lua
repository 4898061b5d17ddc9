-- Keep the writing process within its total bound: drop an ended response's records
-- (``records``: its entry stays, so a replay answers 410, not 404, until it expires), or
-- the response altogether (``all``). Only the response this process wrote (same gen).
-- KEYS: entry, log, index. ARGV: gen, size, mode, id.
local entry, log, index = KEYS[1], KEYS[2], KEYS[3]
local held = redis.call('HMGET', entry, 'gen', 'state', 'total')
if held[1] ~= ARGV[1] or held[2] ~= 'done' then
  return 'gone'
end
redis.call('DEL', log)
if ARGV[3] == 'all' then
  redis.call('DEL', entry)
  redis.call('ZREM', index, ARGV[4])
else
  redis.call('HSET', entry, 'evicted', '1', 'first', held[3], 'size', ARGV[2], 'response', '')
end
return 'ok'
