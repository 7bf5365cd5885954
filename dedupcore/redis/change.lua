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
