-- renew_leases.lua: the heartbeat of one tenant's in-flight requests on one gateway.
-- A lease lives a short TTL and is renewed while its request runs, so a lease nobody
-- renews (its gateway died, or its admission ran after the client gave up) is gone
-- within one TTL, however long requests may run.
--
-- KEYS[1] leases (ZSET id -> expiry ms)   KEYS[2] latches (ZSET conv -> last use ms)
-- KEYS[3] latch info (HASH conv -> "bytes:kind[:digest[:names]]")
-- KEYS[4] finished leases (ZSET id -> expiry ms)   KEYS[5] budget held (STRING Σ tokens)
-- ARGV[1] now ms   ARGV[2] new expiry ms   ARGV[3] number of lease ids N
-- ARGV[4..3+N] lease ids   ARGV[4+N..] conversations whose latch a live request is storing
-- Returns, per lease id, 1 if renewed, 0 if it is no longer held (expired and swept, or
-- released): a lease is never brought back, so a late heartbeat cannot resurrect one.
-- While a token budget holds reservations (admit_request.lua, KEYS[16]), the heartbeat
-- also sweeps expired finished leases (settlements lost with their gateway) so their
-- tokens go even when no admission comes, and keeps the sum alive as long as KEYS[1].
-- Behind prelude/budget_hold.lua (sweep_leases).

local now, expiry, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 1, n do
  local score = redis.call("ZSCORE", KEYS[1], ARGV[3 + i])
  if score and tonumber(score) > 0 then
    redis.call("ZADD", KEYS[1], "XX", expiry, ARGV[3 + i])
    out[i] = 1
  else
    out[i] = 0
  end
end
local ttl = expiry - now + 1000
if redis.call("PTTL", KEYS[1]) < ttl and redis.call("EXISTS", KEYS[1]) == 1 then
  redis.call("PEXPIRE", KEYS[1], ttl)
end
if redis.call("EXISTS", KEYS[5]) == 1 then
  sweep_leases(KEYS[4], KEYS[5], "-inf", now, true)
  local left = redis.call("PTTL", KEYS[1])
  if left > 0 then redis.call("PEXPIRE", KEYS[5], left) end
end
-- A latch still being stored (no digest yet) is in use: keep it out of admission's
-- "abandoned" reclaim (admit_request.lua, ARGV[17]).
for i = 4 + n, #ARGV do
  local info = redis.call("HGET", KEYS[3], ARGV[i])
  if info and not string.match(info, "^%d+:%a+:") then
    redis.call("ZADD", KEYS[2], "XX", now, ARGV[i])
  end
end
return out
