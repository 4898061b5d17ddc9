-- Which of the (provider, model) pairs a live worker somewhere serves now. Needs live.lua.
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
