-- Charge a tenant's tokens-per-minute window, or refuse when it is already spent.
-- Fixed windows of ARGV[3] ms on Redis server time, so every gateway replica agrees.
--
-- KEYS[1]  ns:quota:<tenant>   prefix; the window key is KEYS[1] .. ':' .. window index
-- ARGV[1]  limit (tokens per window)
-- ARGV[2]  charge (prompt tokens + max_tokens; the unused part is refunded later)
-- ARGV[3]  window length in ms
--
-- Returns {admitted 1/0, used before, window index, ms until the window ends}.
-- A request is admitted while the window is below the limit, even if its charge then
-- crosses it: one request never waits on its own size, and the next one is refused.

if redis.replicate_commands then redis.replicate_commands() end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local length = tonumber(ARGV[3])
local window = math.floor(now / length)
local key = KEYS[1] .. ':' .. window
local used = tonumber(redis.call('GET', key) or '0')
local left_ms = (window + 1) * length - now
if used >= tonumber(ARGV[1]) then
  return {0, used, window, left_ms}
end
redis.call('INCRBY', key, tonumber(ARGV[2]))
redis.call('PEXPIRE', key, 2 * length)
return {1, used, window, left_ms}
