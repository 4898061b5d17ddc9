-- One process re-asserts everything it owns, whatever Redis lost meanwhile (a restart,
-- FLUSHALL, an eviction, its own stall past the TTL): its address, its worker list, each
-- worker's row, models and the reservations of the requests it runs, and drops the
-- reservations it released while Redis could not hear it. Idempotent: run every second.
-- Returns ``ok`` and the workers with a free slot while the queue holds entries for their
-- models, or ``mismatch`` (having written nothing else).
local P, inst, address = ARGV[1], ARGV[2], ARGV[3]
local ttl, now, count = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local credentials = ARGV[7]
-- The cluster's credentials are those of its live processes: set by the first process to
-- announce itself when none are held (of two racing with different ones, the first script
-- to run wins), kept by each announce of a process that has them for at least its TTL, so
-- they expire one TTL after the last such process's last announce, like its address. A
-- process with others (another pepper) stays out meanwhile rather than take requests it
-- could not pass on, and takes over once they expired: a deployment restarted with a new
-- pepper forms a cluster again; an old process back from a stall finds the new ones.
local ckey = P .. ':credentials'
local known = redis.call('GET', ckey)
if not known then
  redis.call('SET', ckey, credentials, 'PX', ttl)
elseif known ~= credentials then
  -- Credentials without an expiry were stored by an earlier version, which kept them for
  -- good: give them one, so that they too live on only while a process that has them
  -- announces itself.
  if redis.call('PTTL', ckey) == -1 then
    redis.call('PEXPIRE', ckey, ttl)
  end
  return {'mismatch'}
elseif redis.call('PTTL', ckey) < ttl then
  -- (Never shortened: a process with a shorter TTL must not cut the others' short.)
  redis.call('PEXPIRE', ckey, ttl)
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
  -- Models on demand (SPEC §19): the models it holds without having them loaded (not
  -- routed, but where a load may go), its model slots (0: no bound), how many it has
  -- loaded or loading, and the model it could unload to make room ('' for none).
  local wh = P .. ':wh:' .. wid
  redis.call('DEL', wh)
  local nheld = tonumber(ARGV[i])
  i = i + 1
  for _ = 1, nheld do
    local hkey = P .. ':mh:' .. provider .. ':' .. ARGV[i]
    redis.call('SADD', wh, ARGV[i])
    redis.call('SADD', hkey, wid)
    redis.call('PEXPIRE', hkey, ttl)
    i = i + 1
  end
  redis.call('PEXPIRE', wh, ttl)
  redis.call('HSET', wkey, 'mcap', ARGV[i], 'resident', ARGV[i + 1], 'idle', ARGV[i + 2])
  i = i + 3
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
