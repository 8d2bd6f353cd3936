-- drop_latch.lua: forget latches of a tenant, keeping the byte total exact.
-- KEYS[1] latches ZSET   KEYS[2] latch info HASH   KEYS[3] latch bytes STRING
-- KEYS[4] latch specs HASH
-- ARGV: conversation ids (client form)
-- Returns the number of latches that existed and were removed.
-- Behind prelude/tenant_generation.lua: refused, with nothing written, for a deleted tenant.
local removed = 0
for _, conv in ipairs(ARGV) do
  local info = redis.call("HGET", KEYS[2], conv)
  if info then
    redis.call("ZREM", KEYS[1], conv)
    redis.call("HDEL", KEYS[2], conv)
    redis.call("DECRBY", KEYS[3], tonumber(string.match(info, "^(%d+)") or "0"))
    redis.call("HDEL", KEYS[4], conv)
    removed = removed + 1
  end
end
return removed
