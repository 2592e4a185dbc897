-- KEYS: job, stream, depth. ARGV: now, ttl, group, idem key prefix, events channel, cancel
-- token (new for every call).
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state == 'cancelled' and redis.call('HGET', KEYS[1], 'cancelled_by') == ARGV[6] then
  -- This very call cancelled the queued job and its reply was lost with the connection.
  return 'queued'
end
if state == 'queued' then
  local f = redis.call('HMGET', KEYS[1], 'method', 'entry', 'idem')
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[1],
    'message', 'cancelled', 'cancelled_by', ARGV[6])
  redis.call('HINCRBY', KEYS[3], f[1], -1)
  redis.call('XACK', KEYS[2], ARGV[3], f[2])
  redis.call('XDEL', KEYS[2], f[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if f[3] and f[3] ~= '' then redis.call('PEXPIRE', ARGV[4] .. f[3], ARGV[2]) end
elseif state == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1', 'message', 'cancelling')
end
redis.call('PUBLISH', ARGV[5], state)
return state
