-- One worker's resident prefix hashes, `ns:resident:<id>`, each call atomic.
--
-- KEYS[1]  ns:resident:<id>   SET of 16-hex-digit block hashes, plus the marker
-- ARGV[1]  op: reset | apply
-- ARGV[2]  ttl_ms: the set expires unless the worker reports again within it
-- ARGV[3]  marker "~<incarnation>": which process of the worker the set describes
-- ARGV[4]  n, the number of hashes that became resident, ARGV[5 .. 4+n]; the hashes
--          after them (ARGV[5+n ..]) stopped being resident
--
-- reset  replaces the set with the marker and the n hashes (a snapshot) -> 1
-- apply  if the set holds the marker: adds and removes the hashes, renews the expiry -> 1;
--        else (it expired, Redis lost it, or it is another incarnation's) changes
--        nothing -> 0: the worker must send a snapshot, a delta alone would be partial.

local CHUNK = 1000  -- members per SADD/SREM: Lua's unpack has a stack limit

local function each_chunk(command, from, to)
  local i = from
  while i <= to do
    local j = math.min(i + CHUNK - 1, to)
    redis.call(command, KEYS[1], unpack(ARGV, i, j))
    i = j + 1
  end
end

local op, ttl, marker = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local n = tonumber(ARGV[4])
if op == 'reset' then
  redis.call('DEL', KEYS[1])
  redis.call('SADD', KEYS[1], marker)
  each_chunk('SADD', 5, 4 + n)
elseif op == 'apply' then
  if redis.call('SISMEMBER', KEYS[1], marker) == 0 then
    return 0
  end
  each_chunk('SADD', 5, 4 + n)
  each_chunk('SREM', 5 + n, #ARGV)
else
  return redis.error_reply('residency: unknown op ' .. tostring(op))
end
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
