-- After a failover, trim the load leases one pool inherited from the old primary to what
-- each worker itself reports running. Asynchronous replication means the new primary may
-- still hold leases the old one had released (its counts too high, until they expire);
-- the workers' own signals are the truth. Runs to completion once per pool per primary.
--
-- KEYS[1]  ns:load:<role>    ZSET lease id -> expiry (server ms)
-- KEYS[2]  ns:count:<role>   HASH worker id -> live lease count
-- KEYS[3]  ns:pool:<role>    SET of the pool's worker ids
-- KEYS[4]  ns:reconcile:<replid>:<role>  first-seen server us, then "done"
-- ARGV[1]  "ns:signal:" (a worker's signal hash is ARGV[1] .. id)
-- ARGV[2]  lease TTL in ms (a lease expiring before first-seen + TTL was placed before)
-- ARGV[3]  ms after first-seen to stop waiting for workers whose signal predates it
-- Returns {state, leases trimmed}: state "done" (this call reconciled the pool),
-- "pending" (a worker has not published since the failover yet: call again) or
-- "already" (some router did it).
--
-- A worker's leases are trimmed, oldest expiry first and only among inherited leases,
-- while its count exceeds its signal's running + waiting. A worker without a signal (dead,
-- not yet published) is left to the leases' own expiry.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])

local mark = redis.call('GET', KEYS[4])
if mark == 'done' then return {'already', 0} end
local since_us = tonumber(mark)
if since_us == nil then
  since_us = now_us
  redis.call('SET', KEYS[4], string.format('%.0f', now_us), 'EX', 3600)
end

local running = {}
local stale = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local s = redis.call('HMGET', ARGV[1] .. id, 'published_us', 'running', 'waiting')
  if s[1] then
    if tonumber(s[1]) >= since_us then
      running[id] = tonumber(s[2] or '0') + tonumber(s[3] or '0')
    else
      stale = stale + 1
    end
  end
end
if stale > 0 and now_us - since_us < tonumber(ARGV[3]) * 1000 then return {'pending', 0} end

local trimmed = 0
local cutoff = math.floor(since_us / 1000) + tonumber(ARGV[2])
local inherited = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.0f', cutoff))
for _, lease in ipairs(inherited) do
  local worker = string.match(lease, '^[^:]*:[^:]*:(.*)$')
  local truth = running[worker]
  if truth ~= nil and tonumber(redis.call('HGET', KEYS[2], worker) or '0') > truth then
    redis.call('ZREM', KEYS[1], lease)
    if redis.call('HINCRBY', KEYS[2], worker, -1) <= 0 then
      redis.call('HDEL', KEYS[2], worker)
    end
    trimmed = trimmed + 1
  end
end
redis.call('SET', KEYS[4], 'done', 'EX', 3600)
return {'done', trimmed}
