-- Where each waiting entry stands: ``placed <worker> <owner> <address>`` (a slot was
-- found for it and its notice may have been lost), ``queued``, or ``lost`` (the shared
-- queue no longer holds it: Redis restarted or was flushed).
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
