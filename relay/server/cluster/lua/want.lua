-- Models on demand (SPEC §19): requests wait for a model; load it once, cluster-wide.
-- Needs live.lua.
-- ARGV: P, provider, model, lock ms, scale ('1': a second copy for a loaded model's long
-- queue, only on a free model slot; '0': a model loaded nowhere), now ms.
-- Returns {'loaded'} (nothing to do), {'loading'} (a load is on its way), {'none'} (no live
-- worker holds it), {'busy'} (none can take it now: every one is full of busy models),
-- {'failed'} (every live worker holding it failed to load it lately), or
-- {'sent', worker, process}: the load is that process's to do (recorded in its ops hash,
-- announced on its channel), the lock taken until it reports back or lapses.
local P, provider, model = ARGV[1], ARGV[2], ARGV[3]
local lock_ms, scale, now = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local lock = P .. ':ld:' .. provider .. ':' .. model
if redis.call('EXISTS', lock) == 1 then
  return {'loading'}
end
local loaded = 0
for _, wid in ipairs(redis.call('SMEMBERS', P .. ':m:' .. provider .. ':' .. model)) do
  if live(P, wid, model) then
    loaded = loaded + 1
  end
end
if loaded > 0 and scale ~= '1' then
  return {'loaded'}
end
if loaded == 0 and scale == '1' then
  return {'busy'}  -- (a scale-out asked of a model no longer loaded: the demand path loads it)
end
local failed = P .. ':ldf:' .. provider .. ':' .. model
local holders_key = P .. ':mh:' .. provider .. ':' .. model
local holders, tried = 0, 0
local free, free_load, evict, victim = nil, nil, nil, ''
for _, wid in ipairs(redis.call('SMEMBERS', holders_key)) do
  local w = live(P, wid, nil)
  if not w or redis.call('SISMEMBER', P .. ':wh:' .. wid, model) == 0 then
    redis.call('SREM', holders_key, wid)
  else
    holders = holders + 1
    if redis.call('SISMEMBER', failed, wid) == 1 then
      tried = tried + 1
    elseif w[3] ~= '1' then
      local m = redis.call('HMGET', P .. ':w:' .. wid, 'mcap', 'resident', 'idle')
      local cap, resident, idle = tonumber(m[1] or '0'), tonumber(m[2] or '0'), m[3] or ''
      local leases = P .. ':l:' .. wid
      redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
      local load = redis.call('ZCARD', leases)
      if cap == 0 or resident < cap then
        if free == nil or load < free_load or (load == free_load and wid < free) then
          free, free_load = wid, load
        end
      elseif scale ~= '1' and idle ~= '' and evict == nil
          and tonumber(redis.call('HGET', P .. ':qm:' .. provider, idle) or '0') == 0 then
        evict, victim = wid, idle
      end
    end
  end
end
if holders == 0 then
  return {'none'}
end
local chosen = free
if chosen == nil then
  chosen = evict
else
  victim = ''
end
if chosen == nil then
  if tried == holders and scale ~= '1' then
    return {'failed'}
  end
  return {'busy'}
end
redis.call('SET', lock, chosen, 'PX', lock_ms)
local proc = redis.call('HGET', P .. ':w:' .. chosen, 'proc')
local ops = P .. ':ops:' .. proc
redis.call('HSET', ops, cjson.encode({provider, model}), cjson.encode({chosen, victim, scale}))
redis.call('PEXPIRE', ops, lock_ms)
redis.call('PUBLISH', P .. ':ctl:' .. proc, 'ops')
return {'sent', chosen, proc}
