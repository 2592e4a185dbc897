-- KEYS: job, stream, idem, index, depth. ARGV: id, method, spec, created_at, queue_max,
-- idempotency key, job key prefix.
-- ARGV[1] is new for every call: a job under it means this very call ran already and its reply
-- was lost with the connection (the client sent it again): report it, do not queue it twice.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'created', ARGV[1]} end
if ARGV[6] ~= '' then
  local existing = redis.call('GET', KEYS[3])
  if existing and redis.call('EXISTS', ARGV[7] .. existing) == 1 then
    return {'existing', existing}
  end
end
local queued = 0
for _, n in ipairs(redis.call('HVALS', KEYS[5])) do queued = queued + tonumber(n) end
if queued >= tonumber(ARGV[5]) then return {'full', tostring(queued)} end
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'method', ARGV[2], 'state', 'queued',
  'spec', ARGV[3], 'created_at', ARGV[4], 'progress', '0', 'message', 'queued',
  'attempts', '0', 'error', '', 'cancel', '0', 'idem', ARGV[6], 'entry', entry)
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
if ARGV[6] ~= '' then redis.call('SET', KEYS[3], ARGV[1]) end
return {'created', ARGV[1]}
