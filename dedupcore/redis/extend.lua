-- The renewal of a batch of claims, decided atomically on the Redis server
-- (dedupcore/redis/store.py runs it with EVALSHA, one call per cluster slot),
-- as dedupcore/decision.py's decide_extend decides it, on the server's clock.
--
-- KEYS: the records' hash names. ARGV: lease_ms, ttl_ms (the window a claim of
-- that lease gets), then one token per key. Every key is checked before
-- anything is written; a refusal is the error 'DCNOTCLAIMED <index>',
-- 'DCSTALE <index> <current token>' or 'DCDONE <index>' (a completed claim
-- cannot be renewed). A claim whose lease ran out is renewed while its token
-- is the key's current one. Each renewed record's deadline 'd' becomes now +
-- lease, and its TTL is kept at least ttl_ms so that Redis never forgets a
-- claim before its deadline. The reply is the key count.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
for i, k in ipairs(KEYS) do
  local r = redis.call('HMGET', k, 's', 't')
  if (not r[1]) or r[1] == '3' then
    return redis.error_reply('DCNOTCLAIMED ' .. i)
  end
  if r[2] ~= ARGV[2 + i] then
    return redis.error_reply('DCSTALE ' .. i .. ' ' .. r[2])
  end
  if r[1] == '2' then
    return redis.error_reply('DCDONE ' .. i)
  end
end
for _, k in ipairs(KEYS) do
  redis.call('HSET', k, 'd', deadline)
  if redis.call('PTTL', k) < ttl then
    redis.call('PEXPIRE', k, ttl)
  end
end
return #KEYS
