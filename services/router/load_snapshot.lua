-- Purge every expired load lease of one pool, then report what is left.
--
-- KEYS[1]  ns:load:<role>     ZSET lease id -> expiry
-- KEYS[2]  ns:count:<role>    HASH worker id -> live lease count
-- KEYS[3]  ns:expired:<role>  counter of leases purged because they expired unreleased
-- Returns {number of leases in the ZSET, leases ever purged as expired,
--          worker, count, worker, count, ...}.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, lease in ipairs(expired) do
  local worker = string.match(lease, '^[^:]*:[^:]*:(.*)$')
  if redis.call('HINCRBY', KEYS[2], worker, -1) <= 0 then
    redis.call('HDEL', KEYS[2], worker)
  end
  redis.call('ZREM', KEYS[1], lease)
end
if #expired > 0 then redis.call('INCRBY', KEYS[3], #expired) end

local out = {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[3]) or '0')}
local counts = redis.call('HGETALL', KEYS[2])
for i = 1, #counts do out[#out + 1] = counts[i] end
return out
