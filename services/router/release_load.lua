-- Release load leases of one pool. A lease already expired (and purged) is a no-op, so a
-- late release can never drive a count below the leases that remain.
--
-- KEYS[1]  ns:load:<role>   ZSET lease id -> expiry
-- KEYS[2]  ns:count:<role>  HASH worker id -> live lease count
-- ARGV     lease ids ("<role>:<token>:<worker id>")
-- Returns how many leases were live and are now released.

local released = 0
for _, lease in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], lease) == 1 then
    local worker = string.match(lease, '^[^:]*:[^:]*:(.*)$')
    if redis.call('HINCRBY', KEYS[2], worker, -1) <= 0 then
      redis.call('HDEL', KEYS[2], worker)
    end
    released = released + 1
  end
end
return released
