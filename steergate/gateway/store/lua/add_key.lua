-- add_key.lua: add a new API key's record to its tenant (behind the tenant generation
-- prelude: a key created while its tenant is deleted is never listed by a tenant
-- re-created with the same id).
-- KEYS[1] the tenant's key hash (key id -> record)
-- ARGV[1] key id   ARGV[2] the record (JSON)
-- Returns 1 (added).
redis.call("HSET", KEYS[1], ARGV[1], ARGV[2])
return 1
