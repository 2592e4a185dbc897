-- KEYS: job, stream. ARGV: consumer, state, now, ttl, error, message, result, progress, group,
-- entry, idem prefix, events channel.
local f = redis.call('HMGET', KEYS[1], 'state', 'consumer', 'idem')
-- Already ended so by this worker: this very call ran and its reply was lost with the connection.
if f[1] == ARGV[2] and f[2] == ARGV[1] then return 'ok' end
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 'lost' end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'finished_at', ARGV[3], 'error', ARGV[5],
  'message', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[7]) end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'progress', ARGV[8]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if f[3] and f[3] ~= '' then redis.call('PEXPIRE', ARGV[11] .. f[3], ARGV[4]) end
redis.call('XACK', KEYS[2], ARGV[9], ARGV[10])
redis.call('XDEL', KEYS[2], ARGV[10])
redis.call('PUBLISH', ARGV[12], ARGV[2])
return 'ok'
