-- Shared by the scripts that take entries out of the shared queue (prepended to them).
-- A lane is named ``<class>:<key lane>`` or ``<class>:requeued``; each class has its own
-- ring of key lanes.
local function requeued(lane)
  return string.sub(lane, -9) == ':requeued'
end

local function ring_of(P, provider, lane)
  return P .. ':qr:' .. provider .. ':' .. string.match(lane, '^([^:]*)')
end

local function drop_lane_if_empty(P, provider, lane)
  if not requeued(lane) and redis.call('ZCARD', P .. ':ql:' .. provider .. ':' .. lane) == 0 then
    redis.call('LREM', ring_of(P, provider, lane), 1, lane)
    redis.call('HDEL', P .. ':qc:' .. provider, lane)
    redis.call('HDEL', P .. ':qw:' .. provider, lane)
  end
end

local function unqueue(P, provider, lane, entry)
  local e = redis.call('HMGET', P .. ':qe:' .. entry, 'model', 'class')
  if redis.call('ZREM', P .. ':q:' .. provider, entry) == 1 then
    if e[1] then
      redis.call('HINCRBY', P .. ':qm:' .. provider, e[1], -1)
    end
    redis.call('HINCRBY', P .. ':qk:' .. provider, e[2] or string.match(lane, '^([^:]*)'), -1)
  end
  redis.call('ZREM', P .. ':ql:' .. provider .. ':' .. lane, entry)
  redis.call('DEL', P .. ':qe:' .. entry)
  if redis.call('ZCARD', P .. ':q:' .. provider) == 0 then
    redis.call('DEL', P .. ':qm:' .. provider, P .. ':qk:' .. provider)  -- (any drift ends)
  end
end
