-- Ask a response's writer to stop it (it reads the mark at its next append), or drop the
-- response altogether (``delete``). Returns the entry's fields as they were ({} : none).
-- KEYS: entry, log, index. ARGV: id, delete.
local entry, log, index = KEYS[1], KEYS[2], KEYS[3]
local fields = redis.call('HGETALL', entry)
if #fields == 0 then
  return fields
end
if ARGV[2] == '1' then
  redis.call('DEL', entry, log)
  redis.call('ZREM', index, ARGV[1])
else
  redis.call('HSET', entry, 'cancel', '1')
end
return fields
