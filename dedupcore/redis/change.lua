-- The completion or release of a batch of claims, decided atomically on the
-- Redis server (dedupcore/redis/store.py runs it with EVALSHA, one call per
-- cluster slot).
--
-- KEYS: the records' hash names. ARGV: ttl_ms, new_state ('2' complete,
-- '3' release), then token and result per key. Every key is checked before
-- anything is written; a refusal is the error 'DCNOTCLAIMED <index>',
-- 'DCSTALE <index> <current token>' or 'DCDONE <index>' (a completed claim
-- cannot be released). A key already completed with the same token is left
-- as it is, so a retried completion is a no-op. The reply is the key count.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local state = ARGV[2]
for i, k in ipairs(KEYS) do
  local token = ARGV[1 + 2 * i]
  local r = redis.call('HMGET', k, 's', 't')
  if (not r[1]) or r[1] == '3' then
    return redis.error_reply('DCNOTCLAIMED ' .. i)
  end
  if r[2] ~= token then
    return redis.error_reply('DCSTALE ' .. i .. ' ' .. r[2])
  end
  if r[1] == '2' and state == '3' then
    return redis.error_reply('DCDONE ' .. i)
  end
end
for i, k in ipairs(KEYS) do
  local r = redis.call('HGET', k, 's')
  if r == '1' then
    redis.call('HSET', k, 's', state, 'r', ARGV[2 + 2 * i], 'u', now)
    redis.call('PEXPIRE', k, ttl)
  end
end
return #KEYS
