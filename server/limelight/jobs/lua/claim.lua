-- KEYS: job, depth, stream. ARGV: consumer, now, max_attempts, ttl, group, entry, idem prefix,
-- events channel, claim token (new for every call).
local f = redis.call('HMGET', KEYS[1], 'state', 'method', 'attempts', 'cancel', 'idem', 'claim')
local state = f[1]
if state == 'running' and f[6] == ARGV[9] then
  -- This very call ran already and its reply was lost with the connection: the same answer,
  -- without counting the attempt twice.
  local g = redis.call('HMGET', KEYS[1], 'spec', 'created_at')
  return {'run', f[2], g[1], g[2], f[3]}
end
if not state then
  redis.call('XACK', KEYS[3], ARGV[5], ARGV[6])
  redis.call('XDEL', KEYS[3], ARGV[6])
  return {'missing'}
end
local function finish(new_state, err, msg)
  redis.call('HSET', KEYS[1], 'state', new_state, 'finished_at', ARGV[2], 'error', err,
    'message', msg)
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  if f[5] and f[5] ~= '' then redis.call('PEXPIRE', ARGV[7] .. f[5], ARGV[4]) end
  redis.call('XACK', KEYS[3], ARGV[5], ARGV[6])
  redis.call('XDEL', KEYS[3], ARGV[6])
  redis.call('PUBLISH', ARGV[8], new_state)
end
if state == 'queued' then
  redis.call('HINCRBY', KEYS[2], f[2], -1)
  if f[4] == '1' then
    -- Cancelled while it ran, then handed back by its stopping worker before it saw the
    -- flag: the cancel wins over running it anew.
    finish('cancelled', '', 'cancelled')
    return {'cancelled', f[2]}
  end
elseif state == 'running' then
  if f[4] == '1' then
    finish('cancelled', '', 'cancelled')
    return {'cancelled', f[2]}
  end
  local attempts = tonumber(f[3])
  if attempts >= tonumber(ARGV[3]) then
    local reason = 'worker died ' .. attempts .. ' time' .. (attempts == 1 and '' or 's')
    finish('failed', reason, reason)
    return {'dead', f[2], reason}
  end
else
  redis.call('XACK', KEYS[3], ARGV[5], ARGV[6])
  redis.call('XDEL', KEYS[3], ARGV[6])
  return {'skip', state}
end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[2], 'consumer', ARGV[1],
  'progress', '0', 'message', 'running', 'entry', ARGV[6], 'claim', ARGV[9])
redis.call('PUBLISH', ARGV[8], 'running')
local g = redis.call('HMGET', KEYS[1], 'spec', 'created_at')
return {'run', f[2], g[1], g[2], tostring(attempts)}
