-- A worker's slot was freed (or it arrived, or changed): hand the slot to the queued
-- entry that should go first (highest class, aging, then the keys in turn).
-- Needs live.lua and lanes.lua.
local P, wid, lease = ARGV[1], ARGV[2], ARGV[3]
local now, lease_ms, aging = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local CLASSES = {'priority', 'default', 'flex'}
local leases = P .. ':l:' .. wid
if lease ~= '' then
  redis.call('ZREM', leases, lease)
end
local w = live(P, wid, nil)
if not w or w[3] == '1' then
  return false
end
redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
if redis.call('ZCARD', leases) >= tonumber(w[2]) then
  return false
end
local provider = w[5]
local models = {}
for _, m in ipairs(redis.call('SMEMBERS', P .. ':wm:' .. wid)) do
  models[m] = true
end

-- The oldest entry of a lane this worker can serve (dead entries are pruned on the way).
local function oldest(lane)
  local lane_key = P .. ':ql:' .. provider .. ':' .. lane
  local start = 0
  while true do
    local batch = redis.call('ZRANGE', lane_key, start, start + 63)
    if #batch == 0 then
      return nil
    end
    local kept = 0
    for _, entry in ipairs(batch) do
      local e = redis.call('HMGET', P .. ':qe:' .. entry, 'model', 'origin', 'deadline', 'plain',
                           'at')
      if not e[1] or tonumber(e[3]) <= now or redis.call('EXISTS', P .. ':proc:' .. e[2]) == 0 then
        unqueue(P, provider, lane, entry)
      elseif models[e[1]] and (w[4] ~= '1' or e[4] == '1') then
        return {entry, e[2], tonumber(e[5] or now)}
      else
        kept = kept + 1
      end
    end
    start = start + kept
  end
end

-- The slot goes to ``found``: reserved, and recorded where its process looks for it
-- (the notice on its channel may be lost; the record is read back within a second).
local function take(lane, found)
  unqueue(P, provider, lane, found[1])
  redis.call('ZADD', leases, now + lease_ms, found[1])
  if redis.call('PTTL', leases) < 0 then  -- (announce.lua keeps it after this)
    redis.call('PEXPIRE', leases, lease_ms)
  end
  local address = redis.call('GET', P .. ':proc:' .. w[1]) or ''
  local where = wid .. ' ' .. w[1] .. ' ' .. address
  redis.call('SET', P .. ':pl:' .. found[1], where, 'PX', lease_ms)
  if found[2] ~= w[1] then
    redis.call('PUBLISH', P .. ':ctl:' .. found[2], 'placed ' .. found[1] .. ' ' .. where)
  end
  return {found[1], found[2], where}
end

-- A lane's turn is charged one credit (its turn over: to the back of its ring).
local function charge(lane)
  if redis.call('ZCARD', P .. ':ql:' .. provider .. ':' .. lane) == 0 then
    drop_lane_if_empty(P, provider, lane)
  elseif redis.call('HINCRBY', P .. ':qc:' .. provider, lane, -1) <= 0 then
    local weight = redis.call('HGET', P .. ':qw:' .. provider, lane) or '1'
    redis.call('HSET', P .. ':qc:' .. provider, lane, weight)
    local ring = ring_of(P, provider, lane)
    redis.call('LREM', ring, 1, lane)
    redis.call('RPUSH', ring, lane)
  end
end

-- The highest class with a compatible entry goes first; inside a class, what was put
-- back and what aged into it, by arrival, then the keys in turn. An entry that waited
-- ``aging`` ms per class counts that many classes higher (its oldest compatible one per
-- lane is looked at): nothing that arrived after it aged passes it.
for rank = 1, #CLASSES do
  local class = CLASSES[rank]
  local best, best_lane, best_seq = nil, nil, nil
  local found = oldest(class .. ':requeued')
  if found then
    best, best_lane = found, class .. ':requeued'
    if aging > 0 then
      best_seq = tonumber(redis.call('ZSCORE', P .. ':q:' .. provider, found[1])) or 0
    end
  end
  if aging > 0 then
    for lower = rank + 1, #CLASSES do
      local lanes = redis.call('LRANGE', P .. ':qr:' .. provider .. ':' .. CLASSES[lower], 0, -1)
      table.insert(lanes, CLASSES[lower] .. ':requeued')
      for _, lane in ipairs(lanes) do
        local candidate = oldest(lane)
        if candidate and now - candidate[3] >= (lower - rank) * aging then
          local seq = tonumber(redis.call('ZSCORE', P .. ':q:' .. provider, candidate[1]))
          if best_seq == nil or seq < best_seq then
            best, best_lane, best_seq = candidate, lane, seq
          end
        end
      end
    end
  end
  if best then
    local result = take(best_lane, best)
    if not requeued(best_lane) then
      charge(best_lane)  -- (one put back had its turn already: nothing is charged)
    end
    return result
  end
  local ring = P .. ':qr:' .. provider .. ':' .. class
  for _, lane in ipairs(redis.call('LRANGE', ring, 0, -1)) do
    found = oldest(lane)
    if found then
      local result = take(lane, found)
      charge(lane)
      return result
    end
    drop_lane_if_empty(P, provider, lane)  -- when pruning emptied it
  end
end
return false
