-- cas_tenant.lua: compare-and-set of a tenant's record (an update).
-- KEYS[1] the tenant record   ARGV[1] the record as read   ARGV[2] the new record.
-- Returns 1 if replaced, 0 if it changed or is gone (a delete stays a delete).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
