-- A response ended: its last records, the end marker (``<total>-2``, after every record,
-- which wakes the readers that follow), how it ended, and its retention from now. Only
-- the writer ends it; again is a no-op. ``expect_total`` ('' : any) makes it conditional
-- on no record having been written since (another process settling an orphan; a writer
-- ending a log its store lost the end of). ``confirmed`` ('' : none) is the writer's, as
-- for an append: records the log has already are not added twice, and ``short <total>``
-- says the log lacks some the writer had written.
-- KEYS: entry, log. ARGV: gen, instance, expect_total, confirmed, retain_ms, marker, then
-- the fields to set (count, name, value, ...), then the records (id, data, ...).
local entry, log = KEYS[1], KEYS[2]
local held = redis.call('HMGET', entry, 'gen', 'writer', 'state', 'total')
if held[1] ~= ARGV[1] or held[3] == 'done' then
  return 'gone'
end
if ARGV[2] ~= '' and held[2] ~= ARGV[2] then
  return 'gone'
end
if ARGV[3] ~= '' and held[4] ~= ARGV[3] then
  return 'gone'
end
local have = tonumber(held[4]) or 0
if ARGV[4] ~= '' and have < tonumber(ARGV[4]) then
  return 'short ' .. have
end
local retain = tonumber(ARGV[5])
local nfields = tonumber(ARGV[7])
local fields = {}
for i = 8, 7 + nfields * 2 do
  fields[#fields + 1] = ARGV[i]
end
for i = 8 + nfields * 2, #ARGV, 2 do
  if tonumber(string.match(ARGV[i], '^%d+')) >= have then
    redis.call('XADD', log, ARGV[i], 'd', ARGV[i + 1])
  end
end
redis.call('XADD', log, ARGV[6], 'e', '1')
redis.call('HSET', entry, 'state', 'done', unpack(fields))
redis.call('PEXPIRE', entry, retain)
redis.call('PEXPIRE', log, retain)
return 'ok'
