-- KEYS: job. ARGV: consumer, progress, message, events channel. Returns the cancel flag,
-- or 'lost' when another worker owns the job now.
local f = redis.call('HMGET', KEYS[1], 'state', 'consumer', 'cancel')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 'lost' end
if ARGV[2] ~= '' then
  -- Once a cancel is asked for, the record says 'cancelling' until the job ends: a report the
  -- worker sent before it saw the flag moves the progress only.
  if f[3] == '1' then
    redis.call('HSET', KEYS[1], 'progress', ARGV[2])
  else
    redis.call('HSET', KEYS[1], 'progress', ARGV[2], 'message', ARGV[3])
  end
  redis.call('PUBLISH', ARGV[4], 'progress')
end
return f[3]
