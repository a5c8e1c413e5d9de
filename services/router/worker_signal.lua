-- Worker load signals, each call atomic. One script, dispatched on ARGV[1]. Times are
-- Redis server microseconds (TIME), so publishers' and readers' clocks never mix.
--
-- publish  KEYS[1] = ns:signal:<id>
--          ARGV[2] = ttl_ms, ARGV[3..] = field, value, ... -> the publish time (us)
--   Replaces the hash (a field an older publisher wrote does not linger), stamps it
--   with `published_us` and sets its PX expiry.
-- read     KEYS = ns:pool:<role> for each role to read, ARGV[2] = "ns:signal:"
--          -> {now_us, id, {field, value, ...}, id, {...}, ...}
--   Every pool member whose signal exists; members without one (expired, withdrawn,
--   never published) are left out.

local op = ARGV[1]

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

if op == 'publish' then
  local key = KEYS[1]
  local at = now_us()
  redis.call('DEL', key)
  redis.call('HSET', key, 'published_us', string.format('%.0f', at), unpack(ARGV, 3))
  redis.call('PEXPIRE', key, tonumber(ARGV[2]))
  return at
elseif op == 'read' then
  local out = {now_us()}
  for _, pool in ipairs(KEYS) do
    for _, id in ipairs(redis.call('SMEMBERS', pool)) do
      local fields = redis.call('HGETALL', ARGV[2] .. id)
      if #fields > 0 then
        out[#out + 1] = id
        out[#out + 1] = fields
      end
    end
  end
  return out
end
return redis.error_reply('worker_signal: unknown op ' .. tostring(op))
