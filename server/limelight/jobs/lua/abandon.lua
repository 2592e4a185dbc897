-- KEYS: job, stream, depth. ARGV: consumer, group, entry, events channel.
-- A stopping worker hands its job back: a fresh stream entry, attempt not counted.
local f = redis.call('HMGET', KEYS[1], 'state', 'consumer', 'method', 'id')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 'lost' end
local entry = redis.call('XADD', KEYS[2], '*', 'job', f[4])
redis.call('HSET', KEYS[1], 'state', 'queued', 'progress', '0', 'entry', entry,
  'message', 're-queued: its worker stopped', 'consumer', '')
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
redis.call('HINCRBY', KEYS[3], f[3], 1)
redis.call('XACK', KEYS[2], ARGV[2], ARGV[3])
redis.call('XDEL', KEYS[2], ARGV[3])
redis.call('PUBLISH', ARGV[4], 'queued')
return 'ok'
