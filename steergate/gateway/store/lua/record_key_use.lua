-- record_key_use.lua: write the last-use times one replica noted for a tenant's API keys.
-- KEYS[1] the tenant's key hash (key id -> record)   KEYS[2] last-used hash (key id -> unix s)
-- ARGV: key id, unix seconds, key id, unix seconds, ...
-- A time is written only for a key that still exists (a flush racing a revoke or a tenant
-- delete recreates nothing) and only if it is newer than the stored one (replicas flush
-- independently). Returns the number of times written. One tenant: one slot.
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    local old = tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0') or 0
    if tonumber(ARGV[i + 1]) > old then
      redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
      n = n + 1
    end
  end
end
return n
