-- put_vector.lua: register (or overwrite) a named vector, metadata and data, within quota.
-- KEYS[1] vectors HASH name -> JSON metadata (includes "bytes")
-- KEYS[2] vector data HASH name -> JSON body of the engine's vector PUT
-- ARGV[1] name   ARGV[2] JSON metadata   ARGV[3] its bytes
-- ARGV[4] vector_count quota   ARGV[5] vector_bytes quota   ARGV[6] data
-- Returns {status, previous JSON metadata or ""}: status 0 stored, 1 over quota
-- (nothing written).
-- Behind prelude/tenant_generation.lua: refused, with nothing written, for a deleted tenant.
local prev = redis.call("HGET", KEYS[1], ARGV[1]) or ""
local count, total = 0, 0
for _, meta in ipairs(redis.call("HVALS", KEYS[1])) do
  count = count + 1
  total = total + tonumber(string.match(meta, '"bytes":(%d+)') or "0")
end
if prev ~= "" then
  count = count - 1
  total = total - tonumber(string.match(prev, '"bytes":(%d+)') or "0")
end
if count + 1 > tonumber(ARGV[4]) or total + tonumber(ARGV[3]) > tonumber(ARGV[5]) then
  return {1, prev}
end
redis.call("HSET", KEYS[1], ARGV[1], ARGV[2])
redis.call("HSET", KEYS[2], ARGV[1], ARGV[6])
return {0, prev}
