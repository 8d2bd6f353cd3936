-- sync_latches.lua: make a tenant's latch accounting match what the engines hold.
-- Entries Redis has but no engine has are removed unless touched after ARGV[1]
-- (a request may be storing them right now). Entries engines hold but Redis lacks are
-- returned: the gateway deletes them on the engines (quota already gave their room away).
-- KEYS[1] latches ZSET   KEYS[2] latch info HASH   KEYS[3] latch bytes STRING
-- ARGV[1] grace cutoff ms   ARGV[2..] engine conversation ids (client form)
-- Returns the conversation ids to delete on the engines.
local on_engine = {}
for i = 2, #ARGV do on_engine[ARGV[i]] = true end
local cutoff = tonumber(ARGV[1])
local members = redis.call("ZRANGE", KEYS[1], 0, -1, "WITHSCORES")
local ours = {}
for i = 1, #members, 2 do
  local conv, used = members[i], tonumber(members[i + 1])
  ours[conv] = true
  if not on_engine[conv] and used < cutoff then
    redis.call("ZREM", KEYS[1], conv)
    redis.call("HDEL", KEYS[2], conv)
  end
end
local total = 0
for _, info in ipairs(redis.call("HVALS", KEYS[2])) do
  total = total + tonumber(string.match(info, "^(%d+)") or "0")
end
redis.call("SET", KEYS[3], total)
local orphans = {}
for conv, _ in pairs(on_engine) do
  if not ours[conv] then orphans[#orphans + 1] = conv end
end
return orphans
