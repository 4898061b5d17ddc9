-- A queued entry leaves the shared queue (done, timed out, cancelled). Needs lanes.lua.
local P, provider, entry = ARGV[1], ARGV[2], ARGV[3]
local lane = redis.call('HGET', P .. ':qe:' .. entry, 'lane') or ARGV[4]
unqueue(P, provider, lane, entry)
drop_lane_if_empty(P, provider, lane)
-- A slot found for it that it never took: the worker's id, for the caller to release.
local placed = redis.call('GET', P .. ':pl:' .. entry)
redis.call('DEL', P .. ':pl:' .. entry)
if placed then
  return string.match(placed, '^(%S+)')
end
return false
