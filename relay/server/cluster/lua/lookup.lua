-- Which of the (provider, model) pairs a live worker somewhere serves now, loaded there or
-- not (models on demand). Needs live.lua.
local P = ARGV[1]
local out = {}
for i = 2, #ARGV, 2 do
  local provider, model = ARGV[i], ARGV[i + 1]
  local found = false
  for _, wid in ipairs(redis.call('SMEMBERS', P .. ':m:' .. provider .. ':' .. model)) do
    if live(P, wid, model) then
      found = true
      break
    end
  end
  if not found then
    for _, wid in ipairs(redis.call('SMEMBERS', P .. ':mh:' .. provider .. ':' .. model)) do
      if live(P, wid, nil) and redis.call('SISMEMBER', P .. ':wh:' .. wid, model) == 1 then
        found = true
        break
      end
    end
  end
  if found then
    table.insert(out, provider)
  end
end
return out
