-- The claim of a batch of keys, decided atomically on the Redis server
-- (dedupcore/redis/store.py runs it with EVALSHA, one call per cluster slot).
--
-- This is the one documented second implementation of the claim decision: it
-- answers exactly as dedupcore/decision.py (the reference, whose table is in
-- docs/engine.md) on the Redis server's clock. A lease taken over keeps the
-- first claim's fingerprint and 'c' (created) unless the record had no
-- fingerprint and the new claim gives one, which is then recorded; token,
-- owner, lease and 'u' move. A RELEASED tombstone is replaced by a fresh record
-- (its fingerprint, created = now, token + 1). A key repeated in a batch sees
-- what its earlier copies did, so the fingerprint pass follows each key's first
-- copy: a later copy with another fingerprint than the one the record has (or
-- gets from the first copy) is a conflict for the whole batch. The only
-- deliberate difference: an owner's re-claim renews its lease in the record and
-- sets 'u' (the reference keeps the renewal in memory).
--
-- KEYS: the records' hash names. ARGV: lease_ms, owner ('' for none), ttl_ms,
-- then '1' and one fingerprint per key ('' for none), or '0' and nothing more
-- when the batch has no fingerprints. Every key is checked before anything is
-- written: a fingerprint conflict is the error 'DCCONFLICT <index>'.
-- The reply is flat: {codes, tokens, results}: one outcome digit per key (0 NEW,
-- 1 DUPLICATE, 2 IN_PROGRESS, 3 takeover), the tokens joined by ',', and the
-- stored result of each DUPLICATE in key order.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local owner = ARGV[2]
local ttl = ARGV[3]
local withfp = ARGV[4] == '1'
if withfp then
  -- the fingerprint each key has once its first copy in the batch is decided
  local known = {}
  for i, k in ipairs(KEYS) do
    local fp = ARGV[4 + i]
    local have = known[k]
    if have == nil then
      local r = redis.call('HMGET', k, 's', 'f', 'o', 'd')
      local live = r[1] and r[1] ~= '3'
      have = (live and r[2]) or ''
      if fp ~= '' and have ~= '' and have ~= fp then
        return redis.error_reply('DCCONFLICT ' .. i)
      end
      local mine = owner ~= '' and r[3] == owner
      if have == '' and (not live or (r[1] == '1' and not mine and tonumber(r[4]) <= now)) then
        have = fp  -- a new record or a takeover records this claim's fingerprint
      end
      known[k] = have
    elseif fp ~= '' and have ~= '' and have ~= fp then
      return redis.error_reply('DCCONFLICT ' .. i)
    end
  end
end
local codes, tokens, results = {}, {}, {}
local deadline = now + lease
-- a new PROCESSING record: no 'u' (updated = created) and no empty 'o', 'f' or 'r'
local function create(k, token, fp)
  if owner == '' and fp == '' then
    redis.call('HSET', k, 's', '1', 't', token, 'd', deadline, 'c', now)
  elseif fp == '' then
    redis.call('HSET', k, 's', '1', 't', token, 'd', deadline, 'c', now, 'o', owner)
  elseif owner == '' then
    redis.call('HSET', k, 's', '1', 't', token, 'd', deadline, 'c', now, 'f', fp)
  else
    redis.call('HSET', k, 's', '1', 't', token, 'd', deadline, 'c', now, 'o', owner, 'f', fp)
  end
  redis.call('PEXPIRE', k, ttl)
end
for i, k in ipairs(KEYS) do
  local r = redis.call('HMGET', k, 's', 't', 'o', 'd', 'r')
  local s = r[1]
  if not s then
    create(k, '1', withfp and ARGV[4 + i] or '')
    codes[i] = '0'
    tokens[i] = '1'
  elseif s == '2' then
    codes[i] = '1'
    tokens[i] = r[2]
    results[#results + 1] = r[5] or ''
  elseif s == '3' then
    -- a RELEASED tombstone: a new record whose token continues the old one
    local token = tonumber(r[2]) + 1
    redis.call('DEL', k)
    create(k, token, withfp and ARGV[4 + i] or '')
    codes[i] = '0'
    tokens[i] = token
  elseif owner ~= '' and r[3] == owner then
    redis.call('HSET', k, 'd', deadline, 'u', now)
    codes[i] = '0'
    tokens[i] = r[2]
  elseif tonumber(r[4]) > now then
    codes[i] = '2'
    tokens[i] = r[2]
  else
    -- a takeover: 'c' and the first fingerprint stay; a fingerprint given where
    -- the record had none is recorded (a different one was refused above)
    local token = tonumber(r[2]) + 1
    local fp = withfp and ARGV[4 + i] or ''
    if fp == '' then
      redis.call('HSET', k, 't', token, 'o', owner, 'd', deadline, 'u', now)
    else
      redis.call('HSET', k, 't', token, 'o', owner, 'd', deadline, 'u', now, 'f', fp)
    end
    redis.call('PEXPIRE', k, ttl)
    codes[i] = '3'
    tokens[i] = token
  end
end
return {table.concat(codes), table.concat(tokens, ','), results}
