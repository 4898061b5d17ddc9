-- Push back the expiry of a reservation its request still holds.
local P, wid, lease, expiry = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', P .. ':w:' .. wid) == 1 then
  redis.call('ZADD', P .. ':l:' .. wid, 'XX', expiry, lease)
end
return 1
