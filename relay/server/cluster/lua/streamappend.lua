-- Append records to a response's log, trim what its bound drops (the writer counts the
-- bytes: it wrote every record) and note the response object as it stands. ``gone`` when
-- the writer is no longer this one (replaced, deleted, ended, expired); ``cancel`` when a
-- client asked to stop it. The writer sends again what it could not write (Redis out of
-- reach, or a reply that never came): records the log has already (their first unit
-- below its total) are not added twice. ``short <total>`` when the log holds fewer units
-- than the writer had written (a master that failed over without its last records):
-- nothing is added after the hole.
-- KEYS: entry, log. ARGV: gen, instance, total, first, size, minid ('' : none), response
-- ('' : unchanged), confirmed (the units the log held when these records were made), then
-- the records (id, data, ...).
local entry, log = KEYS[1], KEYS[2]
local held = redis.call('HMGET', entry, 'gen', 'writer', 'state', 'cancel', 'total')
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] or held[3] == 'done' then
  return 'gone'
end
local have = tonumber(held[5]) or 0
if have < tonumber(ARGV[8]) then
  return 'short ' .. have
end
for i = 9, #ARGV, 2 do
  if tonumber(string.match(ARGV[i], '^%d+')) >= have then
    redis.call('XADD', log, ARGV[i], 'd', ARGV[i + 1])
  end
end
if ARGV[6] ~= '' then
  redis.call('XTRIM', log, 'MINID', ARGV[6])
end
-- A log made by its first append (none was made at its opening) expires with its entry.
if redis.call('PTTL', log) == -1 then
  local ttl = redis.call('PTTL', entry)
  if ttl > 0 then
    redis.call('PEXPIRE', log, ttl)
  end
end
redis.call('HSET', entry, 'total', ARGV[3], 'first', ARGV[4], 'size', ARGV[5])
if ARGV[7] ~= '' then
  redis.call('HSET', entry, 'response', ARGV[7])
end
if held[4] == '1' then
  return 'cancel'
end
return 'ok'
