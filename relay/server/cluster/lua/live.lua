-- Shared by the scripts that look at workers (prepended to them).
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
