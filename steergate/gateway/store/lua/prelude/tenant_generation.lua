-- prelude/tenant_generation.lua: put before every script that writes a tenant's state
-- (``scripts.py``, ``TenantCall``). The call's last KEYS entry is the tenant's record and
-- its last ARGV entry the tenant's generation (its ``created_at``) as the request that
-- makes the call authenticated it; both are taken off here, so the script below sees the
-- KEYS and ARGV its header documents. If the record is gone (the tenant was deleted while
-- the request ran) or is a later tenant's of the same id, the script writes nothing and
-- answers the error TENANT_GONE: a request admitted for a deleted tenant never leaves a
-- lease, usage, a latch or a vector for a tenant re-created with its id to inherit.
-- The record is JSON (orjson): `,"` occurs only between members, never inside a string
-- (a quote in a string is escaped), so a tenant's name cannot forge the member matched
-- here; and only the top level has a created_at. A match costs less than cjson.decode
-- (the embedded store runs this Lua in-process on every admission).
local tenant_record = table.remove(KEYS)
local tenant_generation = tonumber(table.remove(ARGV))
local tenant_doc = redis.call("GET", tenant_record)
if not tenant_doc
  or tonumber(string.match(tenant_doc, ',"created_at":([^,}]+)')) ~= tenant_generation then
  return redis.error_reply("TENANT_GONE the tenant was deleted while this request ran")
end
