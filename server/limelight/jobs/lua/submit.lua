-- KEYS: job, stream, idem, index, depth, owner's index. ARGV: id, method, spec, created_at,
-- queue_max, idempotency key, job key prefix, owner tag, owner's queue max ('' for none),
-- owner's retain max, idempotency key prefix.
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
if ARGV[9] ~= '' then
  -- The stream holds every queued and running job: count the owner's queued ones (no counter
  -- to keep right across every transition, and workers that predate the tag count for no one).
  local mine = 0
  for _, entry in ipairs(redis.call('XRANGE', KEYS[2], '-', '+')) do
    local f = redis.call('HMGET', ARGV[7] .. entry[2][2], 'state', 'tag')
    if f[1] == 'queued' and f[2] == ARGV[8] then mine = mine + 1 end
  end
  if mine >= tonumber(ARGV[9]) then return {'owner_full', tostring(mine)} end
end
-- Past the owner's retain max with this job: drop its oldest finished jobs (and forget expired
-- ones); queued and running jobs stay. Looks a bounded way past the excess, so a run of old jobs
-- still queued only delays the trim to a later submission. PEXPIRE 0 deletes a key at once (the
-- ACL's commands already include it, DEL was never needed).
local over = redis.call('ZCARD', KEYS[6]) + 1 - tonumber(ARGV[10])
if over > 0 then
  local oldest = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', '+inf', 'LIMIT', 0, over + 256)
  for _, id in ipairs(oldest) do
    if over <= 0 then break end
    local f = redis.call('HMGET', ARGV[7] .. id, 'state', 'idem')
    if not f[1] then
      redis.call('ZREM', KEYS[6], id)
      over = over - 1
    elseif f[1] == 'succeeded' or f[1] == 'failed' or f[1] == 'cancelled' then
      redis.call('PEXPIRE', ARGV[7] .. id, 0)
      if f[2] and f[2] ~= '' and redis.call('GET', ARGV[11] .. f[2]) == id then
        redis.call('PEXPIRE', ARGV[11] .. f[2], 0)
      end
      redis.call('ZREM', KEYS[6], id)
      redis.call('ZREM', KEYS[4], id)
      over = over - 1
    end
  end
end
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'method', ARGV[2], 'state', 'queued',
  'spec', ARGV[3], 'created_at', ARGV[4], 'progress', '0', 'message', 'queued',
  'attempts', '0', 'error', '', 'cancel', '0', 'idem', ARGV[6], 'entry', entry, 'tag', ARGV[8])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
redis.call('ZADD', KEYS[6], ARGV[4], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
if ARGV[6] ~= '' then redis.call('SET', KEYS[3], ARGV[1]) end
return {'created', ARGV[1]}
