-- Give back the unused part of a tokens-per-minute charge, if its window still exists
-- (an expired window needs no refund, and DECRBY would recreate it without a TTL).
--
-- KEYS[1]  the window key the charge went to (ns:quota:<tenant>:<window index>)
-- ARGV[1]  tokens to give back
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('DECRBY', KEYS[1], tonumber(ARGV[1]))
end
return 0
