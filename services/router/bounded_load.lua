-- Place one request in one pool: purge expired load leases, pick a worker, lease load.
-- One atomic call per pool decision, so the bound holds across any number of routers.
--
-- KEYS[1]  ns:load:<role>   ZSET lease id -> expiry (server ms)
-- KEYS[2]  ns:count:<role>  HASH worker id -> live lease count
-- KEYS[3]  ns:rr:<role>     round-robin counter
-- KEYS[4..] ns:worker:<id>  registration of each candidate, in candidate order
-- ARGV[1]  mode: bounded | first | least | round_robin
-- ARGV[2]  eps (a float's repr, so Lua and Python compute the same bound)
-- ARGV[3]  lease id prefix "<role>:<token>:"; the lease id is prefix .. worker id
-- ARGV[4]  lease TTL in ms
-- ARGV[5]  most expired leases to purge in this call (bounds the script's run time)
-- ARGV[6..] candidate worker ids, in preference order (the ring walk, client-side)
--
-- A candidate counts only if its registration exists and is not draining; total load
-- and n cover counted candidates only. bound = ceil((1 + eps) * (total + 1) / n): since
-- the average load is below the bound, "bounded" always finds a worker.
-- Returns {worker, load before, bound, n, total, rank among counted candidates}, or
-- {"", 0, 0, 0, 0, -1} when no candidate counts.

-- Redis < 7 replicates scripts by effects only if asked; TIME below needs that.
if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[5]))
for _, lease in ipairs(expired) do
  local worker = string.match(lease, '^[^:]*:[^:]*:(.*)$')
  if redis.call('HINCRBY', KEYS[2], worker, -1) <= 0 then
    redis.call('HDEL', KEYS[2], worker)
  end
  redis.call('ZREM', KEYS[1], lease)
end

local live = {}
for i = 6, #ARGV do
  if redis.call('HGET', KEYS[i - 2], 'draining') == '0' then
    live[#live + 1] = ARGV[i]
  end
end
local n = #live
if n == 0 then
  return {'', 0, 0, 0, 0, -1}
end

local counts = redis.call('HMGET', KEYS[2], unpack(live))
local loads = {}
local total = 0
for i = 1, n do
  loads[i] = tonumber(counts[i]) or 0
  total = total + loads[i]
end
local bound = math.ceil((1 + tonumber(ARGV[2])) * (total + 1) / n)

local mode = ARGV[1]
local pick = 1
if mode == 'bounded' then
  pick = nil
  for i = 1, n do
    if loads[i] < bound then
      pick = i
      break
    end
  end
  if pick == nil then
    return redis.error_reply('bounded_load: no worker below the bound (invariant broken)')
  end
elseif mode == 'least' then
  for i = 2, n do
    if loads[i] < loads[pick] then pick = i end
  end
elseif mode == 'round_robin' then
  pick = (redis.call('INCR', KEYS[3]) - 1) % n + 1
elseif mode ~= 'first' then
  return redis.error_reply('bounded_load: unknown mode ' .. mode)
end

local worker = live[pick]
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[3] .. worker)
redis.call('HINCRBY', KEYS[2], worker, 1)
return {worker, loads[pick], bound, n, total, pick - 1}
