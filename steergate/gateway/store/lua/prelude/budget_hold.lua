-- prelude/budget_hold.lua: the one rule of a token budget's held sum (admit_request.lua,
-- KEYS[16]), put before every script that adds or removes leases (``scripts.py``,
-- ``preludes``). An admitted request that counts against its tenant's token budget has a
-- lease id ending in "~<tokens>" (``admission/limits.py``, ``HELD_MARK``): its reservation,
-- held in the sum from its admission until its lease leaves, however it leaves
-- (settlement, or expiry swept by an admission or a heartbeat). Only functions: it
-- writes nothing by itself.

-- The tokens a lease id holds (0: not budget-counted).
local function held_by(lease_id)
  return tonumber(string.match(lease_id, "~(%d+)$") or "0")
end

-- A lease leaves: its tokens leave the sum, and a sum at zero goes.
local function release_held(sum_key, lease_id)
  local n = held_by(lease_id)
  if n > 0 and redis.call("DECRBY", sum_key, n) <= 0 then redis.call("DEL", sum_key) end
end

-- Remove the leases of ZSET ``leases`` scored in [min, max] (expired ones), releasing
-- what they hold; ``holding``: whether the sum exists (else nothing is read twice).
local function sweep_leases(leases, sum_key, min, max, holding)
  if holding then
    for _, id in ipairs(redis.call("ZRANGEBYSCORE", leases, min, max)) do
      release_held(sum_key, id)
    end
  end
  redis.call("ZREMRANGEBYSCORE", leases, min, max)
end
