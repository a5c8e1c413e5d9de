-- Worker registry operations, each atomic. One script, dispatched on ARGV[1].
--
-- KEYS[1]  ns:identity       HASH {model, layout, layout_text} all live workers share,
--                            PX-expiring (layout_text: the layout in words, for errors)
-- KEYS[2]  ns:pool:prefill   SET of worker ids
-- KEYS[3]  ns:pool:decode    SET of worker ids
-- KEYS[4]  ns:pool:mixed     SET of worker ids
-- ARGV[1]  op: register | deregister | drain | down | list
-- ARGV[2]  worker key prefix "ns:worker:" (a worker's key is prefix .. id; single Redis)
--
-- register  ARGV[3..14] = id, role, model, layout, address, capacity, draining, ttl_ms,
--                         incarnation (the worker process's start token), identity (the
--                         JSON of the model's identity parts; '' if unknown),
--                         adapters (ARGV[13]: the LoRA adapters it holds, comma-separated),
--                         layout_text (ARGV[14]: its layout in words; '' if unknown)
--   -> {'ok', created (1 new, 0 renewed)} | {'identity', model, layout, layout_text}
--      | {'role', role}
--   Creates or renews the worker's PX lease. The same id and incarnation under another
--   role moves the worker to that role's pool (a run-time home-role change); another
--   incarnation under another role is refused ({'role', role}). The identity is set by the first live
--   worker and lives as long as the longest worker lease, so it resets only once every
--   worker is gone. Draining is sticky: a heartbeat never un-drains a worker. A new
--   registration, or a new incarnation (the worker restarted), stamps `joined` (Redis
--   time, ms: where its slow start begins) and clears a `down_until` mark.
-- deregister ARGV[3] = id -> 1 if it was registered; drops the identity if no worker is left
-- drain      ARGV[3] = id, ARGV[4] = '1' | '0' -> 1 if the worker is registered
-- down       ARGV[3] = id, ARGV[4] = ms -> 1 if registered: no placements on it until
--   Redis time + ms (`down_until`; a call to it failed: the routers' shared breaker)
-- list       ARGV[3] = role or '' for all
--   -> flat {id, role, model, layout, address, capacity, draining, identity, adapters, ...};
--   prunes expired ids

-- Redis < 7 replicates scripts by effects only if asked; TIME below needs that.
if redis.replicate_commands then redis.replicate_commands() end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local pools = {prefill = KEYS[2], decode = KEYS[3], mixed = KEYS[4]}
local op = ARGV[1]
local prefix = ARGV[2]

local function live_members(pool)
  local alive = {}
  for _, id in ipairs(redis.call('SMEMBERS', pool)) do
    if redis.call('EXISTS', prefix .. id) == 1 then
      alive[#alive + 1] = id
    else
      redis.call('SREM', pool, id)
    end
  end
  return alive
end

if op == 'register' then
  local id, role, model, layout = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
  local ttl = tonumber(ARGV[10])
  local key = prefix .. id
  if pools[role] == nil then
    return redis.error_reply('registry: unknown role ' .. role)
  end
  local known = redis.call('HMGET', KEYS[1], 'model', 'layout', 'layout_text')
  if known[1] and (known[1] ~= model or known[2] ~= layout) then
    return {'identity', known[1], known[2], known[3] or ''}
  end
  local old = redis.call('HMGET', key, 'role', 'draining', 'incarnation')
  if old[1] and old[1] ~= role then
    -- The same process under another role is a home-role change: it leaves its old
    -- pool in this same call, so no reader sees it in two pools or in none. Another
    -- process with the same id is refused.
    if ARGV[11] == '' or old[3] ~= ARGV[11] then
      return {'role', old[1]}
    end
    if pools[old[1]] then redis.call('SREM', pools[old[1]], id) end
  end
  local draining = ARGV[9]
  if old[2] == '1' then draining = '1' end
  redis.call('HSET', key, 'role', role, 'model', model, 'layout', layout,
             'address', ARGV[7], 'capacity', ARGV[8], 'draining', draining,
             'identity', ARGV[12] or '', 'adapters', ARGV[13] or '')
  if not old[1] or old[3] ~= ARGV[11] then
    redis.call('HSET', key, 'joined', now_ms(), 'incarnation', ARGV[11])
    redis.call('HDEL', key, 'down_until')
  end
  redis.call('PEXPIRE', key, ttl)
  redis.call('SADD', pools[role], id)
  redis.call('HSET', KEYS[1], 'model', model, 'layout', layout)
  -- A caller that does not describe its layout (a tool, an older worker) keeps the text
  -- another worker of the same layout left.
  if (ARGV[14] or '') ~= '' then
    redis.call('HSET', KEYS[1], 'layout_text', ARGV[14])
  end
  if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  if old[1] then return {'ok', 0} end
  return {'ok', 1}
elseif op == 'deregister' then
  local id = ARGV[3]
  local existed = redis.call('DEL', prefix .. id)
  local left = 0
  for _, pool in pairs(pools) do
    redis.call('SREM', pool, id)
    left = left + #live_members(pool)
  end
  if left == 0 then redis.call('DEL', KEYS[1]) end
  return existed
elseif op == 'drain' then
  local key = prefix .. ARGV[3]
  if redis.call('EXISTS', key) == 0 then return 0 end
  redis.call('HSET', key, 'draining', ARGV[4])
  return 1
elseif op == 'down' then
  local key = prefix .. ARGV[3]
  if redis.call('EXISTS', key) == 0 then return 0 end
  redis.call('HSET', key, 'down_until', now_ms() + tonumber(ARGV[4]))
  return 1
elseif op == 'list' then
  local out = {}
  for _, role in ipairs({'prefill', 'decode', 'mixed'}) do
    if ARGV[3] == '' or ARGV[3] == role then
      for _, id in ipairs(live_members(pools[role])) do
        local f = redis.call('HMGET', prefix .. id, 'role', 'model', 'layout', 'address',
                             'capacity', 'draining', 'identity', 'adapters')
        out[#out + 1] = id
        for i = 1, 8 do out[#out + 1] = f[i] or '' end
      end
    end
  end
  return out
end
return redis.error_reply('registry: unknown op ' .. tostring(op))
