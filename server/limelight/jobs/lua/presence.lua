-- A worker announces that it consumes the queue. KEYS: the workers' sorted set (member: a
-- worker's name, score: until when its announcement holds, in ms of Redis's own clock, so that
-- the pods' clocks never matter). ARGV: the worker's name, for how many ms it holds.
-- Drops the announcements that ran out (sidecars only count, with ZCOUNT from now on).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)
return redis.call('ZCARD', KEYS[1])
