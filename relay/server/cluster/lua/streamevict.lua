-- Drop the records of an ended response to stay within the writing process's total bound:
-- its entry stays (a replay then answers 410, not 404) until it expires.
-- KEYS: entry, log. ARGV: gen, size.
local entry, log = KEYS[1], KEYS[2]
local held = redis.call('HMGET', entry, 'gen', 'state', 'total')
if held[1] ~= ARGV[1] or held[2] ~= 'done' then
  return 'gone'
end
redis.call('DEL', log)
redis.call('HSET', entry, 'evicted', '1', 'first', held[3], 'size', ARGV[2], 'response', '')
return 'ok'
