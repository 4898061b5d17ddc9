-- provider, model, loaded ('1', or '0' for a model a worker holds without having it loaded:
-- models on demand) for the live workers of every live process; dead processes leave the
-- process list here.
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
          table.insert(out, '1')
        end
        for _, model in ipairs(redis.call('SMEMBERS', P .. ':wh:' .. wid)) do
          table.insert(out, provider)
          table.insert(out, model)
          table.insert(out, '0')
        end
      end
    end
  end
end
return out
