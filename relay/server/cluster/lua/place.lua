-- Place one request: reserve a slot on the best live worker for its model (cache-aware
-- within the bounded-load guard, else least load, this process's workers first on a tie;
-- or, under speed-aware routing, the lowest predicted time to first token within the
-- guard), or put it in the shared queue. Needs live.lua and lanes.lua.
local P, provider, model = ARGV[1], ARGV[2], ARGV[3]
local now, lease, lease_ms = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local origin, deadline = ARGV[7], tonumber(ARGV[8])
local seq, max_queue, plain = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]
local lane, weight = ARGV[12], tonumber(ARGV[13])
local own_lease_ms, class = tonumber(ARGV[14]), ARGV[15]
-- Cache-aware routing (SPEC §14): the conversation's anchor ('' for none; hashed with
-- the request's API key, so one key's conversations never name another's worker unless
-- the relay shares prefixes across keys), the bounded-load guard's factor and slack,
-- and how long the conversation's worker is remembered.
local anchor, factor = ARGV[16] or '', tonumber(ARGV[17] or '1.25')
local anchor_ttl = tonumber(ARGV[18] or '3600000')
local slack = tonumber(ARGV[19] or '0')
-- Speed-aware routing (SPEC §21): the placing process's predicted costs, in ms, from the
-- speeds every process shares ('' for none: least load decides). Each entry is
-- ``<worker> <base> <per request in flight> <saved when it holds the conversation>``,
-- entries separated by ';'; a worker without one costs the defaults (ARGV[21], [22]).
-- A worker's cost is its base plus its load (read here, atomically) times its per-request
-- cost, less its saving when it is the conversation's worker.
local costs_arg = ARGV[20] or ''
local default_base, default_per = tonumber(ARGV[21] or '0'), tonumber(ARGV[22] or '0')
-- Least load prefers the placing process's own workers: one with a free slot and at most
-- this many requests in flight above the least loaded takes the request (it would
-- otherwise cross Redis both ways); 0: only on a tie.
local local_slack = tonumber(ARGV[23] or '0')
local members_key = P .. ':m:' .. provider .. ':' .. model
local best, ties, near = nil, {}, {}
local open, total, mine = {}, 0, {}
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
      if w[1] == origin then
        table.insert(mine, {wid, load})
      end
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
  redis.call('PEXPIRE', P .. ':seq', 86400000)  -- (outlives every entry; no key without TTL)
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
if local_slack > 0 and #mine > 0 and not chosen then
  -- The least loaded of this process's workers, when within the slack of the least.
  local low, own = nil, {}
  for _, c in ipairs(mine) do
    if c[2] <= best + local_slack then
      if low == nil or c[2] < low then
        low, own = c[2], {}
      end
      if c[2] == low then
        table.insert(own, c[1])
      end
    end
  end
  if #own > 0 then
    near = own
  end
end
if costs_arg ~= '' and #open > 0 then
  -- The lowest predicted cost within the guard (it supersedes the anchor's own rule:
  -- the cache is one input of the prediction, the home's saving).
  local costs = {}
  for entry in string.gmatch(costs_arg, '[^;]+') do
    local wid, base, per, hit = string.match(entry, '^(%S+) (%S+) (%S+) (%S+)$')
    if wid then
      costs[wid] = {tonumber(base), tonumber(per), tonumber(hit)}
    end
  end
  local home = nil
  if anchor ~= '' then
    home = redis.call('GET', anchor_key)
  end
  local bound = math.max(math.ceil(factor * (total + 1) / #open), best + 1 + slack)
  local low, cheapest, near_cheap = nil, {}, {}
  for _, c in ipairs(open) do
    if c[2] + 1 <= bound then
      local known = costs[c[1]]
      local cost
      if known then
        cost = known[1] + c[2] * known[2]
        if c[1] == home then
          cost = cost - known[3]
        end
      else
        cost = default_base + c[2] * default_per
      end
      if low == nil or cost < low - 1e-9 then
        low, cheapest, near_cheap = cost, {}, {}
      end
      if cost <= low + 1e-9 then
        table.insert(cheapest, c[1])
        if redis.call('HGET', P .. ':w:' .. c[1], 'proc') == origin then
          table.insert(near_cheap, c[1])
        end
      end
    end
  end
  if #cheapest > 0 then
    ties, near, chosen = cheapest, near_cheap, nil
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
    redis.call('PEXPIRE', P .. ':rr:' .. provider, 86400000)
    wid = pool[(turn % #pool) + 1]
  end
  local proc = redis.call('HGET', P .. ':w:' .. wid, 'proc')
  if proc == origin then  -- the request is there already: held until its deadline
    lease_ms = own_lease_ms
  end
  redis.call('ZADD', P .. ':l:' .. wid, now + lease_ms, lease)
  if redis.call('PTTL', P .. ':l:' .. wid) < 0 then  -- (announce.lua keeps it after this)
    redis.call('PEXPIRE', P .. ':l:' .. wid, lease_ms)
  end
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
