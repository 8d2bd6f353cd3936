-- drop_vector.lua: forget a named vector, metadata and data together.
-- KEYS[1] vectors HASH   KEYS[2] vector data HASH
-- ARGV[1] name
-- Returns 1 if the vector existed, else 0.
-- Behind prelude/tenant_generation.lua: refused, with nothing written, for a deleted tenant.
redis.call("HDEL", KEYS[2], ARGV[1])
return redis.call("HDEL", KEYS[1], ARGV[1])
