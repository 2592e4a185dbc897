-- KEYS: job. ARGV: consumer, progress, message, events channel. Returns the cancel flag,
-- or 'lost' when another worker owns the job now.
local f = redis.call('HMGET', KEYS[1], 'state', 'consumer', 'cancel')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 'lost' end
if ARGV[2] ~= '' then
  redis.call('HSET', KEYS[1], 'progress', ARGV[2], 'message', ARGV[3])
  redis.call('PUBLISH', ARGV[4], 'progress')
end
return f[3]
