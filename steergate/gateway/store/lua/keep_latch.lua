-- keep_latch.lua: record the latch an engine has just stored (its digest and spec),
-- before the turn's answer reaches the client, so the next turn can restore it anywhere.
-- KEYS[1] latches ZSET   KEYS[2] latch info HASH   KEYS[3] latch bytes STRING
-- KEYS[4] latch specs HASH
-- ARGV[1] conversation id (client form)   ARGV[2] info "bytes:kind:digest[:names]"   ARGV[3] spec
-- Returns 0 when recorded; 1 when the conversation is no longer in the ledger (the
-- tenant's quota evicted it while the turn ran): the caller drops it on the engine.
-- Behind prelude/tenant_generation.lua: refused, with nothing written, for a deleted tenant.
local cur = redis.call("HGET", KEYS[2], ARGV[1])
if not cur then return 1 end
local function bytes_of(info) return tonumber(string.match(info, "^(%d+)") or "0") end
redis.call("INCRBY", KEYS[3], bytes_of(ARGV[2]) - bytes_of(cur))
redis.call("HSET", KEYS[2], ARGV[1], ARGV[2])
redis.call("HSET", KEYS[4], ARGV[1], ARGV[3])
return 0
