-- Become the writer of a response's log, once its first bytes come (or its end, when it
-- ended before any): refused (``gone``) when it was replaced, deleted or has ended, or when
-- another process writes it. Its expiry becomes the request's lifetime plus retention.
-- KEYS: entry, log. ARGV: gen, instance, ttl_ms.
local entry, log = KEYS[1], KEYS[2]
local gen, instance, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local held = redis.call('HMGET', entry, 'gen', 'writer', 'state', 'cancel')
if held[1] ~= gen or held[3] == 'done' then
  return 'gone'
end
if held[2] and held[2] ~= '' and held[2] ~= instance then
  return 'gone'
end
redis.call('HSET', entry, 'writer', instance, 'state', 'running')
redis.call('PEXPIRE', entry, ttl)
redis.call('PEXPIRE', log, ttl)
if held[4] == '1' then
  return 'cancel'
end
return 'ok'
