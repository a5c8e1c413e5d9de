-- One gateway's fairness tick for every priority class, in one atomic call: charge the
-- KV-block-seconds its requests held since the last tick, mark its backlogged tenants,
-- and read every tenant's decayed attained service. Redis server time, so all gateway
-- replicas decay alike.
--
-- KEYS     per class, in class order: ns:fair:<class> (HASH tenant -> "<value> <ms>"),
--          ns:fairq:<class> (ZSET tenant -> backlog expiry ms)
-- ARGV[1]  half-life of attained service, ms
-- ARGV[2]  how long a backlog mark lives unrenewed, ms
-- ARGV[3]  number of classes
-- then per class: n, n x (tenant, amount), m, m x tenant
--   amounts are weight-normalised KV-block-seconds (block-seconds / tenant weight)
--
-- Returns per class a flat list tenant, value, backlogged (1/0) of every tenant with
-- attained service or a live backlog mark. Values are strings (Lua numbers would be
-- truncated to integers on the way out).

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local half_life = tonumber(ARGV[1])
local backlog_ttl = tonumber(ARGV[2])
local classes = tonumber(ARGV[3])
local ln2 = math.log(2)
local negligible = 1e-6

local function decayed(entry)
  if not entry then return 0 end
  local sep = string.find(entry, ' ')
  local value = tonumber(string.sub(entry, 1, sep - 1))
  local stamp = tonumber(string.sub(entry, sep + 1))
  return value * math.exp(-(now - stamp) * ln2 / half_life)
end

local out = {}
local at = 4
for c = 1, classes do
  local hash, queue = KEYS[2 * c - 1], KEYS[2 * c]
  local n = tonumber(ARGV[at]); at = at + 1
  for _ = 1, n do
    local tenant, amount = ARGV[at], tonumber(ARGV[at + 1]); at = at + 2
    local value = decayed(redis.call('HGET', hash, tenant)) + amount
    redis.call('HSET', hash, tenant, string.format('%.17g %d', value, now))
  end
  local m = tonumber(ARGV[at]); at = at + 1
  for _ = 1, m do
    local tenant = ARGV[at]; at = at + 1
    local expiry = now + backlog_ttl
    local old = tonumber(redis.call('ZSCORE', queue, tenant) or '0')
    if expiry > old then redis.call('ZADD', queue, expiry, tenant) end
  end
  redis.call('ZREMRANGEBYSCORE', queue, '-inf', now)
  local backlogged = {}
  for _, tenant in ipairs(redis.call('ZRANGE', queue, 0, -1)) do backlogged[tenant] = true end
  local rows = {}
  local flat = redis.call('HGETALL', hash)
  for i = 1, #flat, 2 do
    local tenant, value = flat[i], decayed(flat[i + 1])
    if value < negligible and not backlogged[tenant] then
      redis.call('HDEL', hash, tenant)
    else
      rows[#rows + 1] = tenant
      rows[#rows + 1] = string.format('%.17g', value)
      rows[#rows + 1] = backlogged[tenant] and 1 or 0
      backlogged[tenant] = nil
    end
  end
  for tenant, _ in pairs(backlogged) do
    rows[#rows + 1] = tenant; rows[#rows + 1] = '0'; rows[#rows + 1] = 1
  end
  if #flat > 0 then redis.call('PEXPIRE', hash, 20 * half_life) end
  redis.call('PEXPIRE', queue, backlog_ttl)
  out[c] = rows
end
return out
