-- cas_key.lua: compare-and-set of one API key record (a rotation).
-- KEYS[1] the tenant's key hash   ARGV[1] key id   ARGV[2] the record as read
-- ARGV[3] the new record. Returns 1 if replaced, 0 if it changed or is gone.
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
