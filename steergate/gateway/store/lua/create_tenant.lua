-- create_tenant.lua: a tenant's record, written only where none is (SET NX), over a
-- clean slate: what an earlier tenant of the same id left (a delete that failed midway
-- and was never retried) goes in the same call, so a tenant created again starts empty.
-- KEYS[1] the tenant record   KEYS[2..] every other key a tenant can own (one slot)
-- ARGV[1] the record.   Returns 1 if created, 0 if the id is taken.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if #KEYS > 1 then redis.call('DEL', unpack(KEYS, 2)) end
redis.call('SET', KEYS[1], ARGV[1])
return 1
