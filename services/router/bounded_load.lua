-- Place one request in one pool: purge expired load leases, pick a worker, lease load.
-- One atomic call per pool decision, so the bound holds across any number of routers.
--
-- KEYS[1]  ns:load:<role>   ZSET lease id -> expiry (server ms)
-- KEYS[2]  ns:count:<role>  HASH worker id -> live lease count
-- KEYS[3]  ns:rr:<role>     round-robin counter
-- KEYS[4]  ns:cacheseq:<role>  counter ordering the cache model's uses (cache_aware only)
-- KEYS[5]  ns:expired:<role>   counter of leases purged because they expired unreleased
-- KEYS[6 .. 5+m]     ns:worker:<id>  registration of each of the m candidates, in order
-- KEYS[6+m .. 5+2m]  ns:cache:<role>:<id>   ZSET prefix key -> last use seq (cache_aware)
-- KEYS[6+2m .. 5+3m] ns:cachew:<role>:<id>  HASH prefix key -> weight, "~used" -> sum
-- KEYS[6+3m .. 5+4m] ns:resident:<id>  SET of the block hashes the worker reported
--                    holding, and its marker "~<incarnation>" (cache_aware)
-- ARGV[1]  mode: cache_aware | bounded | first | least | round_robin
-- ARGV[2]  eps (a float's repr, so Lua and Python compute the same bound)
-- ARGV[3]  lease id prefix "<role>:<token>:"; the lease id is prefix .. worker id
-- ARGV[4]  lease TTL in ms
-- ARGV[5]  most expired leases to purge in this call (bounds the script's run time)
-- ARGV[6]  prefix key (hex) of the request (cache_aware only)
-- ARGV[7]  its weight: full KV blocks of the prompt (cache_aware only)
-- ARGV[8]  share of a worker's registered KV capacity the cache model assumes
-- ARGV[9]  cache model TTL in ms (idle models of departed workers expire)
-- ARGV[10] slow start in ms (0: off)
-- ARGV[11] blocks the prefix key stands for (what a cache model's hit is worth)
-- ARGV[12] h: how many of the prompt's leading block hashes follow (cache_aware; else 0;
--          0 also makes cache_aware ignore the reports and use the cache models alone)
-- ARGV[13 .. 12+h]   those hashes (hex), in prompt order
-- ARGV[13+h ..]      the m candidate worker ids, in preference order (the ring walk)
--
-- A candidate counts only if its registration exists, is not draining and is not marked
-- down (`down_until` in the future: a call to it failed; when every live candidate is
-- marked down they all count, rather than none); total load and n cover counted
-- candidates only. bound = ceil((1 + eps) * (total + 1) / n): since the average load is
-- below the bound, "bounded" always finds a worker.
--
-- Slow start (bounded modes): once some candidate joined more than the slow start ago,
-- a younger one (new, or restarted: `joined` is stamped at registration) is below the
-- bound only while its load is under ceil(bound x share), share growing linearly from
-- MIN_SHARE to 1 over the slow start, so a cold cache is not stampeded. If no candidate
-- is under its own limit, the plain bound decides (the invariant above still holds).
-- Workers that all joined together (a fresh cluster) have nobody warmer to defer to.
--
-- cache_aware is bounded, preferring the candidate that holds the longest run of the
-- prompt's leading blocks. A worker that reports its cache (its resident set exists)
-- is taken at its word: the run is how many leading hashes the set holds, 0 if the set
-- carries another incarnation's marker (the worker restarted: its cache began empty).
-- A worker that does not report falls back on the router's model of its cache: which
-- prefix keys it served recently (LRU order in the ZSET, weights in the HASH); holding
-- the key counts as a run of ARGV[11] blocks. Among candidates below the bound, the one
-- with the longest run (> 0) wins (ties: the least loaded, then the earlier in the
-- order); if none has a run, the first below the bound, as in "bounded". The pick's model
-- then records the key as most recently used and evicts least recently used keys beyond
-- capacity x share, as an LRU prefix cache would (kept for workers that stop reporting).
-- Returns {worker, load before, bound, n, total, rank among counted candidates, run,
-- best run}, or {"", 0, 0, 0, 0, -1, 0, 0} when no candidate counts. run is the pick's
-- run in blocks and best run the longest any counted candidate had, bound or not
-- (cache_aware only; else both 0).

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
if #expired > 0 then redis.call('INCRBY', KEYS[5], #expired) end

local MIN_SHARE = 0.1
local h = tonumber(ARGV[12])
local first_candidate = 13 + h
local m = #ARGV - first_candidate + 1
local up, down = {}, {}
for j = 1, m do
  local reg = redis.call('HMGET', KEYS[5 + j], 'draining', 'capacity', 'joined', 'down_until',
                         'incarnation')
  if reg[1] == '0' then
    local entry = {ARGV[first_candidate - 1 + j], j, tonumber(reg[2]) or 0, tonumber(reg[3]) or 0,
                   reg[5] or ''}
    if reg[4] and tonumber(reg[4]) > now then
      down[#down + 1] = entry
    else
      up[#up + 1] = entry
    end
  end
end
if #up == 0 then up = down end
local live, slot, capacity, joined, incarnation = {}, {}, {}, {}, {}
for i, entry in ipairs(up) do
  live[i], slot[i], capacity[i], joined[i], incarnation[i] =
    entry[1], entry[2], entry[3], entry[4], entry[5]
end
local n = #live
if n == 0 then
  return {'', 0, 0, 0, 0, -1, 0, 0}
end

local counts = redis.call('HMGET', KEYS[2], unpack(live))
local loads = {}
local total = 0
for i = 1, n do
  loads[i] = tonumber(counts[i]) or 0
  total = total + loads[i]
end
local bound = math.ceil((1 + tonumber(ARGV[2])) * (total + 1) / n)

-- Each candidate's own limit under slow start (see the header).
local slow = tonumber(ARGV[10])
local established = false
for i = 1, n do
  if slow <= 0 or now - joined[i] >= slow then established = true end
end
local limit = {}
for i = 1, n do
  limit[i] = bound
  if established and now - joined[i] < slow then
    local share = math.max(MIN_SHARE, (now - joined[i]) / slow)
    limit[i] = math.max(1, math.ceil(bound * share))
  end
end

local mode = ARGV[1]
local cached = mode == 'cache_aware'
if #KEYS ~= 5 + (cached and 4 or 1) * m then
  return redis.error_reply('bounded_load: KEYS do not match the candidates for mode ' .. mode)
end

-- Leading blocks of the prompt candidate i holds (see the header): from its report, or
-- else from the router's model of its cache.
local function run_of(i)
  local resident = KEYS[5 + 3 * m + slot[i]]
  if h > 0 and redis.call('EXISTS', resident) == 1 then
    local found = redis.call('SMISMEMBER', resident, '~' .. incarnation[i],
                             unpack(ARGV, 13, 12 + h))
    if found[1] == 0 then
      return 0  -- another incarnation's report: this one restarted with an empty cache
    end
    local run = 0
    for j = 2, #found do
      if found[j] == 0 then break end
      run = run + 1
    end
    return run
  end
  if redis.call('ZSCORE', KEYS[5 + m + slot[i]], ARGV[6]) then
    return tonumber(ARGV[11])
  end
  return 0
end

-- The candidate below its limit with the longest run (ties: least loaded, earlier), or
-- nil if none has one; and the longest run of any candidate.
local function warm_pick()
  local best, best_run, reachable = nil, 0, 0
  for i = 1, n do
    local run = run_of(i)
    if run > reachable then reachable = run end
    if run > 0 and loads[i] < limit[i] then
      if best == nil or run > best_run or (run == best_run and loads[i] < loads[best]) then
        best, best_run = i, run
      end
    end
  end
  return best, best_run, reachable
end

-- Record the key as the pick's most recent use; evict least recently used keys until
-- the model's summed weight fits the worker's capacity x share.
local function remember(i)
  local lru, weights = KEYS[5 + m + slot[i]], KEYS[5 + 2 * m + slot[i]]
  local weight = tonumber(ARGV[7])
  local old = tonumber(redis.call('HGET', weights, ARGV[6])) or 0
  redis.call('ZADD', lru, redis.call('INCR', KEYS[4]), ARGV[6])
  redis.call('HSET', weights, ARGV[6], weight)
  local used = redis.call('HINCRBY', weights, '~used', weight - old)
  local cap = math.floor(capacity[i] * tonumber(ARGV[8]))
  while cap > 0 and used > cap do
    local oldest = redis.call('ZPOPMIN', lru)
    if #oldest == 0 then break end
    local w = tonumber(redis.call('HGET', weights, oldest[1])) or 0
    redis.call('HDEL', weights, oldest[1])
    -- 0 - w, not -w: a prompt shorter than a block weighs 0, Lua's -0 reaches Redis as
    -- the string "-0", and HINCRBY refuses that as not an integer (the script fails).
    used = redis.call('HINCRBY', weights, '~used', 0 - w)
  end
  redis.call('PEXPIRE', lru, ARGV[9])
  redis.call('PEXPIRE', weights, ARGV[9])
end

local pick = nil
local run, reachable = 0, 0
if cached then
  pick, run, reachable = warm_pick()
end
if mode == 'bounded' or mode == 'cache_aware' then
  if pick == nil then
    for i = 1, n do
      if loads[i] < limit[i] then
        pick = i
        break
      end
    end
  end
  if pick == nil then  -- only slow-starting workers had room: the plain bound decides
    for i = 1, n do
      if loads[i] < bound then
        pick = i
        break
      end
    end
  end
  if pick == nil then
    return redis.error_reply('bounded_load: no worker below the bound (invariant broken)')
  end
elseif mode == 'least' then
  pick = 1
  for i = 2, n do
    if loads[i] < loads[pick] then pick = i end
  end
elseif mode == 'round_robin' then
  pick = (redis.call('INCR', KEYS[3]) - 1) % n + 1
elseif mode == 'first' then
  pick = 1
else
  return redis.error_reply('bounded_load: unknown mode ' .. mode)
end
if cached then remember(pick) end

local worker = live[pick]
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[3] .. worker)
redis.call('HINCRBY', KEYS[2], worker, 1)
return {worker, loads[pick], bound, n, total, pick - 1, run, reachable}
