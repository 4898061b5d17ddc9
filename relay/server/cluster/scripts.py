"""The Lua scripts behind :mod:`relay.server.cluster.state`: each decision that must be
atomic across server processes runs in Redis alone.

Keys are those listed in :mod:`relay.server.cluster.state`. A worker counts as live only
while its process's address key exists *and* that process lists it (``pw``): the
per-model sets (``m``) are hints, pruned of anything a live process does not confirm,
so a worker can never be offered after its process dropped it or died.
"""

from __future__ import annotations

#: Lua shared by the scripts that look at workers.
_LIVE = """
-- The worker's row when it is live and (if ``model`` is given) acked for it, else nil.
local function live(P, wid, model)
  local w = redis.call('HMGET', P .. ':w:' .. wid, 'proc', 'max', 'draining', 'picky', 'provider')
  if not w[1] or redis.call('EXISTS', P .. ':proc:' .. w[1]) == 0 then
    return nil
  end
  if redis.call('SISMEMBER', P .. ':pw:' .. w[1], wid) == 0 then
    return nil
  end
  if model and redis.call('SISMEMBER', P .. ':wm:' .. wid, model) == 0 then
    return nil
  end
  return w
end
"""

#: Lua shared by the scripts that take entries out of the shared queue. A lane is named
#: ``<class>:<key lane>`` or ``<class>:requeued``; each class has its own ring of key lanes.
_LANES = """
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
"""

PLACE = (
    _LIVE
    + _LANES
    + """
local P, provider, model = ARGV[1], ARGV[2], ARGV[3]
local now, lease, lease_ms = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local origin, deadline = ARGV[7], tonumber(ARGV[8])
local seq, max_queue, plain = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]
local lane, weight = ARGV[12], tonumber(ARGV[13])
local own_lease_ms, class = tonumber(ARGV[14]), ARGV[15]
-- Cache-aware routing (SPEC §14): the conversation's anchor ('' for none), the
-- bounded-load guard's factor and slack, and how long the conversation's worker is
-- remembered.
local anchor, factor = ARGV[16] or '', tonumber(ARGV[17] or '1.25')
local anchor_ttl = tonumber(ARGV[18] or '3600000')
local slack = tonumber(ARGV[19] or '0')
local members_key = P .. ':m:' .. provider .. ':' .. model
local best, ties, near = nil, {}, {}
local open, total = {}, 0
for _, wid in ipairs(redis.call('SMEMBERS', members_key)) do
  local w = live(P, wid, model)
  if not w then
    redis.call('SREM', members_key, wid)
  elseif w[3] ~= '1' and (plain == '1' or w[4] ~= '1') then
    local leases = P .. ':l:' .. wid
    redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
    local load = redis.call('ZCARD', leases)
    if load < tonumber(w[2]) then
      table.insert(open, {wid, load})
      total = total + load
      if best == nil or load < best then
        best, ties, near = load, {}, {}
      end
      if load == best then
        table.insert(ties, wid)
        if w[1] == origin then
          table.insert(near, wid)  -- connected to the process that has the request
        end
      end
    end
  end
end
if seq == 0 then
  seq = redis.call('INCR', P .. ':seq')
end
local chosen, spilled = nil, '0'
local anchor_key = P .. ':aff:' .. provider .. ':' .. anchor
if anchor ~= '' and #open > 0 then
  -- The worker that took the conversation's last turn, while it has room within the
  -- guard; else least-load, which becomes the conversation's worker.
  local home = redis.call('GET', anchor_key)
  if home then
    local bound = math.max(math.ceil(factor * (total + 1) / #open), best + 1 + slack)
    for _, c in ipairs(open) do
      if c[1] == home then
        if c[2] + 1 <= bound then
          chosen = home
        else
          spilled = '1'
        end
      end
    end
  end
end
if #ties > 0 then
  local wid
  if chosen then
    wid = chosen
  else
    local pool = ties
    if #near > 0 then
      pool = near
    end
    table.sort(pool)
    local turn = redis.call('INCR', P .. ':rr:' .. provider)
    wid = pool[(turn % #pool) + 1]
  end
  local proc = redis.call('HGET', P .. ':w:' .. wid, 'proc')
  if proc == origin then  -- the request is there already: held until its deadline
    lease_ms = own_lease_ms
  end
  redis.call('ZADD', P .. ':l:' .. wid, now + lease_ms, lease)
  if anchor ~= '' then
    redis.call('SET', anchor_key, wid, 'PX', anchor_ttl)
  end
  return {'placed', wid, proc, redis.call('GET', P .. ':proc:' .. proc) or '', seq, spilled}
end
local queue = P .. ':q:' .. provider
-- The bound is per class: a flood of bulk work never gets people refused.
if max_queue >= 0 and tonumber(redis.call('HGET', P .. ':qk:' .. provider, class) or '0')
    >= max_queue then
  return {'full', '', '', '', seq, '0'}
end
if redis.call('ZADD', queue, seq, lease) == 1 then
  redis.call('HINCRBY', P .. ':qm:' .. provider, model, 1)
  redis.call('HINCRBY', P .. ':qk:' .. provider, class, 1)
end
local lane_key = P .. ':ql:' .. provider .. ':' .. lane
if not requeued(lane) then
  local weights = P .. ':qw:' .. provider
  if redis.call('ZCARD', lane_key) == 0 then
    redis.call('RPUSH', ring_of(P, provider, lane), lane)  -- joins at the back, full credit
    redis.call('HSET', P .. ':qc:' .. provider, lane, weight)
  elseif tonumber(redis.call('HGET', weights, lane) or weight) ~= weight then
    local credits = P .. ':qc:' .. provider
    local credit = tonumber(redis.call('HGET', credits, lane) or weight)
    redis.call('HSET', credits, lane, math.min(credit, weight))
  end
  redis.call('HSET', weights, lane, weight)
end
redis.call('ZADD', lane_key, seq, lease)
redis.call('HSET', P .. ':qe:' .. lease, 'model', model, 'origin', origin, 'deadline', deadline,
           'plain', plain, 'lane', lane, 'class', class, 'at', now)
redis.call('PEXPIREAT', P .. ':qe:' .. lease, deadline)
return {'queued', '', '', '', seq, '0'}
"""
)

RELEASE = (
    _LIVE
    + _LANES
    + """
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
-- back first, then the keys in turn. An entry that waited ``aging`` ms per class counts
-- that many classes higher (its oldest compatible one per lane is looked at).
for rank = 1, #CLASSES do
  local class = CLASSES[rank]
  local found = oldest(class .. ':requeued')
  if found then
    return take(class .. ':requeued', found)  -- it had its turn already: nothing is charged
  end
  if aging > 0 then
    local best, best_lane, best_seq = nil, nil, nil
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
    if best then
      local result = take(best_lane, best)
      if not requeued(best_lane) then
        charge(best_lane)
      end
      return result
    end
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
"""
)

WITHDRAW = (
    _LANES
    + """
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
"""
)

EXTEND = """
local P, wid, lease, expiry = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', P .. ':w:' .. wid) == 1 then
  redis.call('ZADD', P .. ':l:' .. wid, 'XX', expiry, lease)
end
return 1
"""

#: One process re-asserts everything it owns, whatever Redis lost meanwhile (a restart,
#: FLUSHALL, an eviction, its own stall past the TTL): its address, its worker list, each
#: worker's row, models and the reservations of the requests it runs, and drops the
#: reservations it released while Redis could not hear it. Idempotent: run every second.
#: Returns ``ok`` and the workers with a free slot while the queue holds entries for their
#: models, or ``mismatch``.
ANNOUNCE = """
local P, inst, address = ARGV[1], ARGV[2], ARGV[3]
local ttl, now, count = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local credentials = ARGV[7]
-- The cluster's credentials are those of the first process to announce itself; a process
-- with others (another pepper) stays out rather than take requests it could not pass on.
local known = redis.call('GET', P .. ':credentials')
if not known then
  redis.call('SET', P .. ':credentials', credentials)
elseif known ~= credentials then
  return {'mismatch'}
end
redis.call('SET', P .. ':proc:' .. inst, address, 'PX', ttl)
redis.call('SADD', P .. ':procs', inst)
local pw = P .. ':pw:' .. inst
redis.call('DEL', pw)
local feed = {'ok'}
local i = 8
for _ = 1, count do
  local wid, provider, most, draining, picky = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3],
    ARGV[i + 4]
  local nmodels = tonumber(ARGV[i + 5])
  i = i + 6
  redis.call('SADD', pw, wid)
  local wkey = P .. ':w:' .. wid
  redis.call('HSET', wkey, 'proc', inst, 'provider', provider, 'max', most,
             'draining', draining, 'picky', picky)
  redis.call('PEXPIRE', wkey, ttl)
  local wm = P .. ':wm:' .. wid
  redis.call('DEL', wm)
  for _ = 1, nmodels do
    local mkey = P .. ':m:' .. provider .. ':' .. ARGV[i]
    redis.call('SADD', wm, ARGV[i])
    redis.call('SADD', mkey, wid)
    redis.call('PEXPIRE', mkey, ttl)
    i = i + 1
  end
  redis.call('PEXPIRE', wm, ttl)
  local wanted = false
  for _, model in ipairs(redis.call('SMEMBERS', wm)) do
    if tonumber(redis.call('HGET', P .. ':qm:' .. provider, model) or '0') > 0 then
      wanted = true
      break
    end
  end
  local lkey = P .. ':l:' .. wid
  local held = tonumber(ARGV[i])
  i = i + 1
  local announced = {}
  for _ = 1, held do
    redis.call('ZADD', lkey, tonumber(ARGV[i + 1]), ARGV[i])
    announced[ARGV[i]] = true
    i = i + 2
  end
  local released = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, released do
    redis.call('ZREM', lkey, ARGV[i])
    i = i + 1
  end
  redis.call('ZREMRANGEBYSCORE', lkey, '-inf', now)
  -- A reservation the worker's process does not hold is one on its way here (placed by
  -- another process a moment ago) or one whose request never came (its process lost
  -- the reply, or died): kept for one TTL from when the owner first announced the
  -- worker without it, then dropped. (A request arriving later still finds the worker's
  -- real capacity checked where it is served.)
  local akey = P .. ':la:' .. wid
  local since = {}
  local old = redis.call('HGETALL', akey)
  for j = 1, #old, 2 do
    since[old[j]] = tonumber(old[j + 1])
  end
  redis.call('DEL', akey)
  for _, lease in ipairs(redis.call('ZRANGE', lkey, 0, -1)) do
    if not announced[lease] then
      local first = since[lease] or now
      if now - first >= ttl then
        redis.call('ZREM', lkey, lease)
      else
        redis.call('HSET', akey, lease, first)
        redis.call('PEXPIRE', akey, 2 * ttl)
      end
    end
  end
  redis.call('PEXPIRE', lkey, ttl)
  if wanted and draining ~= '1' and redis.call('ZCARD', lkey) < tonumber(most) then
    table.insert(feed, wid)
  end
end
redis.call('PEXPIRE', pw, ttl)
return feed
"""

#: provider -> models served by the live workers of every live process; dead processes
#: leave the process list here.
SERVED = """
local P = ARGV[1]
local out = {}
for _, inst in ipairs(redis.call('SMEMBERS', P .. ':procs')) do
  if redis.call('EXISTS', P .. ':proc:' .. inst) == 0 then
    redis.call('SREM', P .. ':procs', inst)
  else
    for _, wid in ipairs(redis.call('SMEMBERS', P .. ':pw:' .. inst)) do
      local provider = redis.call('HGET', P .. ':w:' .. wid, 'provider')
      if provider then
        for _, model in ipairs(redis.call('SMEMBERS', P .. ':wm:' .. wid)) do
          table.insert(out, provider)
          table.insert(out, model)
        end
      end
    end
  end
end
return out
"""

#: Which of the (provider, model) pairs a live worker somewhere serves now.
LOOKUP = (
    _LIVE
    + """
local P = ARGV[1]
local out = {}
for i = 2, #ARGV, 2 do
  local provider, model = ARGV[i], ARGV[i + 1]
  for _, wid in ipairs(redis.call('SMEMBERS', P .. ':m:' .. provider .. ':' .. model)) do
    if live(P, wid, model) then
      table.insert(out, provider)
      break
    end
  end
end
return out
"""
)

#: Where each waiting entry stands: ``placed <worker> <owner> <address>`` (a slot was
#: found for it and its notice may have been lost), ``queued``, or ``lost`` (the shared
#: queue no longer holds it: Redis restarted or was flushed).
WHERE = """
local P = ARGV[1]
local out = {}
for i = 2, #ARGV, 2 do
  local provider, entry = ARGV[i], ARGV[i + 1]
  local placed = redis.call('GET', P .. ':pl:' .. entry)
  if placed then
    table.insert(out, 'placed ' .. placed)
  elseif redis.call('ZSCORE', P .. ':q:' .. provider, entry) then
    table.insert(out, 'queued')
  else
    table.insert(out, 'lost')
  end
end
return out
"""
