-- settle_request.lua: account one finished request (off the hot path, batched):
-- release its lease, correct the token reservation to actual usage, count its status,
-- and fix latch state from the engine's x-steering-latch answer.
--
-- KEYS: as admit_request.lua (gcra:req, gcra:tok, leases, usage minute, usage total,
--       latches, latch info, latch bytes, latch specs, vectors)
-- ARGV[1] now ms   ARGV[2] lease id   ARGV[3] tpm   ARGV[4] token delta (actual - reserved)
-- ARGV[5] status class ("2xx"|"4xx"|"5xx"|"")   ARGV[6] tokens used
-- ARGV[7] conversation id ("" = none)
-- ARGV[8] latch action: "" none | "keep" engine stored it | "record" engine stored it and
--         keep_latch.lua could not record it (Redis was unavailable as the turn ended):
--         write ARGV[19] (its entry) and ARGV[20] (its spec) as keep_latch.lua would have,
--         while the entry is still the pending one this turn's admission left (ARGV[16])
--         | "drop" the latch is gone
--         (refused or stale: its spec goes too) |
--         "restore" request failed: put ARGV[9] (previous info, "" = none) back; the spec
--         hash was never changed by the failed request (keep_latch.lua writes it)
-- ARGV[9] previous latch info   ARGV[10] usage minute TTL s
-- ARGV[11] cancel: the lease's expiry ms if this settles an admission whose answer never
--          came ("0" otherwise). If it has not run (yet), a tombstone (score -expiry)
--          makes admit_request.lua refuse it should it run later (a hung Redis).
-- ARGV[12] prompt tokens   ARGV[13] completion tokens (their sum is ARGV[6])
-- ARGV[14] API key id ("" = none)   ARGV[15] rollup TTL s
-- KEYS[11] usage day   KEYS[12] usage month   KEYS[14] the key's leases: the day and month
-- rollups get the tokens and the status class (the tenant's, and the key's as
-- k:<key_id>:<field>); the key's lease is released with the tenant's.
-- KEYS[15] finished leases: a lease an admission already released (admit_request.lua,
-- ARGV[26+N..]) is found there, not in KEYS[3]; it is still this settlement's to charge.
-- KEYS[16] budget held: a settled lease whose id ends in "~<tokens>" no longer holds them.
-- ARGV[16] the conversation's ledger entry as this request's admission left it (its
--          pending "bytes:kind", or the entry it found): "drop" and "restore" apply only
--          while the entry is still that one. A concurrent turn that recorded or replaced
--          the latch since owns it: a failed or stale turn must not undo that (absent: a
--          gateway of the previous version, no check).
-- ARGV[17] latch_count quota   ARGV[18] latch_bytes quota
-- ARGV[19] "record": the entry to write ("" otherwise)   ARGV[20] "record": its spec
-- ARGV[21..] per latch this
--          request's admission evicted: conversation, last use, ledger entry, spec (as
--          admit_request.lua returned them). A "drop" or "restore" puts each back, most
--          recently used first, unless its conversation latched again since or it no
--          longer fits the quota: a turn whose latch was not kept (refused by the
--          engine, failed upstream) costs no other conversation its latch. "keep": the
--          evictions stand.
-- Returns 1 when action was "keep" or "record" but the latch is no longer ours in Redis (it was
-- evicted while the request ran). Nothing needs doing about it: an engine never bridges
-- a latch Redis does not expect, and the engine sync deletes its copy. Else 0.
--
-- Idempotent, so a settlement whose reply was lost can be sent again: the counters and
-- the token correction apply only while the request's lease is still held (the first
-- run releases it, from KEYS[3] or KEYS[15]). The latch actions converge to the same
-- state when repeated.
-- Behind prelude/tenant_generation.lua: refused, with nothing written, for a deleted tenant;
-- and prelude/budget_hold.lua (release_held).

local now = tonumber(ARGV[1])
local score = redis.call("ZSCORE", KEYS[3], ARGV[2])
local held = score and tonumber(score) > 0
if held then redis.call("ZREM", KEYS[3], ARGV[2]) end
if redis.call("ZREM", KEYS[15], ARGV[2]) == 1 then held = true end
redis.call("ZREM", KEYS[14], ARGV[2])
if held then release_held(KEYS[16], ARGV[2]) end
local cancel = tonumber(ARGV[11] or "0")
if cancel > 0 and not held and cancel > now then
  redis.call("ZADD", KEYS[3], -cancel, ARGV[2])
  local ttl = cancel - now + 1000
  if redis.call("PTTL", KEYS[3]) < ttl then redis.call("PEXPIRE", KEYS[3], ttl) end
end

local delta = held and tonumber(ARGV[4]) or 0
if delta ~= 0 then
  local interval = 60000 / tonumber(ARGV[3])
  local tat = tonumber(redis.call("GET", KEYS[2]) or now)
  if delta > 0 and tat < now then tat = now end
  tat = tat + delta * interval
  if tat > now then
    redis.call("SET", KEYS[2], tat, "PX", math.ceil(tat - now) + 1000)
  else
    redis.call("DEL", KEYS[2])
  end
end

if held then
  if ARGV[5] ~= "" then
    redis.call("HINCRBY", KEYS[4], ARGV[5], 1)
    redis.call("HINCRBY", KEYS[5], ARGV[5], 1)
  end
  local used = tonumber(ARGV[6])
  if used > 0 then
    redis.call("HINCRBY", KEYS[4], "tokens", used)
    redis.call("HINCRBY", KEYS[5], "tokens", used)
  end
  redis.call("EXPIRE", KEYS[4], tonumber(ARGV[10]))
  local prompt, completion = tonumber(ARGV[12]), tonumber(ARGV[13])
  local kp = ARGV[14] ~= "" and ("k:" .. ARGV[14] .. ":") or nil
  local function add(field, n)
    if n <= 0 then return end
    redis.call("HINCRBY", KEYS[11], field, n)
    if kp then redis.call("HINCRBY", KEYS[11], kp .. field, n) end
    redis.call("HINCRBY", KEYS[12], field, n)
  end
  add("prompt_tokens", prompt)
  add("completion_tokens", completion)
  add("tokens", prompt + completion)
  if ARGV[5] ~= "" then add(ARGV[5], 1) end
  redis.call("EXPIRE", KEYS[11], tonumber(ARGV[15]))
  redis.call("EXPIRE", KEYS[12], tonumber(ARGV[15]))
end

local conv, action = ARGV[7], ARGV[8]
if conv == "" or action == "" then return 0 end
local cur = redis.call("HGET", KEYS[7], conv)
local function bytes_of(info) return tonumber(string.match(info or "0", "^(%d+)") or "0") end

local function unevict()
  if ARGV[21] == nil then return end
  local max_count, max_bytes = tonumber(ARGV[17]), tonumber(ARGV[18])
  local count = redis.call("ZCARD", KEYS[6])
  local total = tonumber(redis.call("GET", KEYS[8]) or "0")
  for i = #ARGV - 3, 21, -4 do
    local victim, used, info, spec = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    local nbytes = bytes_of(info)
    if info ~= "" and redis.call("HEXISTS", KEYS[7], victim) == 0
        and count + 1 <= max_count and total + nbytes <= max_bytes then
      redis.call("ZADD", KEYS[6], tonumber(used), victim)
      redis.call("HSET", KEYS[7], victim, info)
      redis.call("HSET", KEYS[9], victim, spec)
      redis.call("INCRBY", KEYS[8], nbytes)
      count, total = count + 1, total + nbytes
    end
  end
end

if action ~= "keep" and action ~= "record" and ARGV[16] ~= nil and (cur or "") ~= ARGV[16] then
  unevict()
  return 0
end
local function remove()
  if cur then
    redis.call("ZREM", KEYS[6], conv)
    redis.call("HDEL", KEYS[7], conv)
    redis.call("DECRBY", KEYS[8], bytes_of(cur))
  end
end
if action == "keep" then
  if not cur then return 1 end
  return 0
elseif action == "record" then
  if not cur then return 1 end
  -- Another turn's entry (it recorded or replaced the latch since), or this one's already
  -- written (a keep_latch.lua whose reply was lost): theirs, left as it is.
  if cur == ARGV[16] then
    redis.call("INCRBY", KEYS[8], bytes_of(ARGV[19]) - bytes_of(cur))
    redis.call("HSET", KEYS[7], conv, ARGV[19])
    redis.call("HSET", KEYS[9], conv, ARGV[20])
  end
  return 0
elseif action == "drop" then
  remove()
  redis.call("HDEL", KEYS[9], conv)
elseif action == "restore" then
  -- Only over the entry this turn's admission left: if it is gone, a quota eviction or a
  -- client DELETE removed the conversation meanwhile, and putting the earlier state back
  -- would resurrect it (over the quota, without its spec).
  if cur then
    remove()
    if ARGV[9] ~= "" then
      redis.call("ZADD", KEYS[6], now, conv)
      redis.call("HSET", KEYS[7], conv, ARGV[9])
      redis.call("INCRBY", KEYS[8], bytes_of(ARGV[9]))
    else
      redis.call("HDEL", KEYS[9], conv)
    end
  end
end
unevict()  -- "drop" or "restore": this turn's latch was not kept
return 0
