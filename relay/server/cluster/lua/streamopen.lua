-- Keep a new resumable response (SPEC §18): its entry (a hash), its log (a stream whose
-- entry ids are ``<first unit>-1``) and its place in its owner's index (a sorted set by
-- creation time). With ``replace`` (llama.cpp: a conversation's new stream) an entry of
-- the same id is dropped first. The owner holds at most ``per_key`` responses: at the
-- bound, its index is pruned of expired entries, then its oldest ended response makes
-- room; when every one still runs the answer is ``full`` and nothing is written.
-- KEYS: entry, log, index. ARGV: base (the owner's key prefix), id, replace, per_key,
-- ttl_ms, index_ttl_ms, created_ms, then the entry's fields (name, value, ...) and, after
-- a count, the log's first records (id, data, ...).
local entry, log, index = KEYS[1], KEYS[2], KEYS[3]
local base, id = ARGV[1], ARGV[2]
local replace, per_key = ARGV[3] == '1', tonumber(ARGV[4])
local ttl, index_ttl, created = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local nfields = tonumber(ARGV[8])
if redis.call('EXISTS', entry) == 1 then
  if not replace then
    return 'exists'
  end
  redis.call('DEL', entry, log)
  redis.call('ZREM', index, id)
end
if redis.call('ZCARD', index) >= per_key then
  for _, other in ipairs(redis.call('ZRANGE', index, 0, -1)) do
    if redis.call('EXISTS', base .. other .. ':m') == 0 then
      redis.call('ZREM', index, other)
    end
  end
  if redis.call('ZCARD', index) >= per_key then
    for _, other in ipairs(redis.call('ZRANGE', index, 0, -1)) do
      if redis.call('HGET', base .. other .. ':m', 'state') == 'done' then
        redis.call('DEL', base .. other .. ':m', base .. other .. ':s')
        redis.call('ZREM', index, other)
        break
      end
    end
  end
  if redis.call('ZCARD', index) >= per_key then
    return 'full'
  end
end
local fields = {}
for i = 9, 8 + nfields * 2 do
  fields[#fields + 1] = ARGV[i]
end
redis.call('HSET', entry, unpack(fields))
redis.call('PEXPIRE', entry, ttl)
local at = 9 + nfields * 2
local nrecords = tonumber(ARGV[at])
for i = 0, nrecords - 1 do
  redis.call('XADD', log, ARGV[at + 1 + i * 2], 'd', ARGV[at + 2 + i * 2])
end
if nrecords > 0 then
  redis.call('PEXPIRE', log, ttl)
end
redis.call('ZADD', index, created, id)
if redis.call('PTTL', index) < index_ttl then
  redis.call('PEXPIRE', index, index_ttl)
end
return 'ok'
