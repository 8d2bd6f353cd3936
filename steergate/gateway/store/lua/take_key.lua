-- take_key.lua: take an API key record out (a revocation), atomically against a
-- rotation. KEYS[1] the tenant's key hash   KEYS[2] its last-used hash   ARGV[1] key id
-- Returns the record as it was, or nil.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return cur
