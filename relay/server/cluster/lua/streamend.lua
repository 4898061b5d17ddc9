-- A response ended: its last records, the end marker (``<total>-2``, after every record,
-- which wakes the readers that follow), how it ended, and its retention from now. Only
-- the writer ends it; again is a no-op. ``expect_total`` ('' : any) makes it conditional
-- on no record having been written since (another process settling an orphan).
-- KEYS: entry, log. ARGV: gen, instance, expect_total, retain_ms, marker, then the fields
-- to set (count, name, value, ...), then the records (id, data, ...).
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
local retain = tonumber(ARGV[4])
local nfields = tonumber(ARGV[6])
local fields = {}
for i = 7, 6 + nfields * 2 do
  fields[#fields + 1] = ARGV[i]
end
for i = 7 + nfields * 2, #ARGV, 2 do
  redis.call('XADD', log, ARGV[i], 'd', ARGV[i + 1])
end
redis.call('XADD', log, ARGV[5], 'e', '1')
redis.call('HSET', entry, 'state', 'done', unpack(fields))
redis.call('PEXPIRE', entry, retain)
redis.call('PEXPIRE', log, retain)
return 'ok'
