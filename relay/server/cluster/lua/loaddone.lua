-- Models on demand (SPEC §19): the worker the cluster chose reported how its load went.
-- ARGV: P, provider, model, worker, outcome ('1' loaded, '0' failed, '' not started: the
-- worker could not take it by then), lock ms.
-- The lock is dropped (when it is still this worker's); a failure is remembered for a
-- lock's time so that the next choice is another worker.
local P, provider, model, wid, ok = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local lock = P .. ':ld:' .. provider .. ':' .. model
if redis.call('GET', lock) == wid then
  redis.call('DEL', lock)
end
local failed = P .. ':ldf:' .. provider .. ':' .. model
if ok == '1' then
  redis.call('DEL', failed)
elseif ok == '0' then
  redis.call('SADD', failed, wid)
  redis.call('PEXPIRE', failed, tonumber(ARGV[6]))
end
return 1
