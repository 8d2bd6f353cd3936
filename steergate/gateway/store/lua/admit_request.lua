-- admit_request.lua: the whole admission decision for one inference request, atomically,
-- in one round trip: concurrency lease, requests/min and tokens/min (GCRA), latch quota.
-- Nothing is written unless the request is admitted (except the 429 usage counter and
-- the release of this gateway's finished leases, ARGV[26+N..]).
--
-- KEYS[1] gcra:req (TAT ms)   KEYS[2] gcra:tok (TAT ms)   KEYS[3] leases (ZSET id -> expiry ms)
-- KEYS[4] usage minute hash   KEYS[5] usage total hash
-- KEYS[6] latches (ZSET conv -> last use ms)  KEYS[7] latch info (HASH conv -> "bytes:kind")
-- KEYS[8] latch bytes (STRING Σ bytes)   KEYS[9] latch specs (HASH conv -> spec)
-- KEYS[10] vectors (HASH name -> JSON metadata)
-- ARGV[1] now ms   ARGV[2] rpm   ARGV[3] tpm   ARGV[4] token cost (<= tpm)
-- ARGV[5] max_concurrency   ARGV[6] lease id   ARGV[7] lease expiry ms
-- ARGV[8] conversation id ("" = none)   ARGV[9] "1" = store a latch
-- ARGV[10] latch bytes   ARGV[11] latch kind ("value"|"ref")
-- ARGV[12] latch_count quota   ARGV[13] latch_bytes quota   ARGV[14] policy ("evict_oldest"|"reject")
-- ARGV[15] usage minute TTL s
-- ARGV[16] deadline, in Redis's clock (TIME, ms; "0" = none): an admission that runs later
--          is refused with no write at all. Its client has given up (timed out, answered
--          503), so a lease taken now would be held by nobody (a hung Redis replays them).
-- ARGV[17] pending horizon ms: a ledger entry without a digest (a turn storing it, see
--          keep_latch.lua) not touched for this long has no turn left storing it (live
--          ones are refreshed by renew_leases.lua): it is reclaimed, not counted.
-- ARGV[18] API key id   ARGV[19] the key's own rpm ("0" = none)
-- ARGV[20] the key's own max_concurrency ("0" = none)
-- ARGV[21] token budget ("0" = none)   ARGV[22] "day" | "month": which rollup it reads
-- ARGV[23] ms until the budget's period rolls over (UTC)   ARGV[24] rollup TTL s
-- ARGV[25] number of named vectors N   ARGV[26..25+N] their names
-- KEYS[11] usage day (rollup hash)   KEYS[12] usage month (rollup hash)
-- KEYS[13] the key's own GCRA (TAT ms)   KEYS[14] the key's leases (ZSET id -> admit ms)
-- KEYS[15] finished leases (ZSET id -> expiry ms): released, settlement not yet run
-- KEYS[16] budget held (STRING Σ tokens): the reservations of admitted, unsettled requests
--          that count against the token budget. Such a request's lease id ends in
--          "~<tokens>" (the gateway adds it when the tenant has a budget); its tokens
--          leave the sum when its lease leaves KEYS[3] and KEYS[15], however it leaves
--          (settlement, or expiry swept here or by renew_leases.lua). The sum lives as
--          long as KEYS[3], so it vanishes with the leases it counts.
-- ARGV[26+N] number of finished lease ids M   ARGV[27+N..26+N+M] lease ids of this
--          tenant's requests whose answers ended on this gateway, settlement not yet
--          applied: released here, before concurrency is counted, whatever the decision
--          (moved to KEYS[15], where settle_request.lua still finds them to charge once).
-- Returns {status, retry_ms, req_remaining, req_reset_ms, tok_remaining, tok_reset_ms,
--          latch_info of the conversation before this request ("" if none),
--          N digests of the named vectors ("" where the tenant has no such vector),
--          R digests of the vectors the latch before this request references (R: the
--          names in its entry, see key_names.LatchEntry; "" where deleted),
--          E, E evicted conv ids, then per evicted conv its last use, ledger entry and
--          spec, or "" "" "" where it was no recorded latch (a pending entry): the
--          gateway hands them back to settle_request.lua should the turn not keep its
--          latch, so a failed turn's evictions are undone where they still fit}
-- status: 0 admitted, 1 requests/min, 2 tokens/min, 3 concurrency, 4 latch quota,
--         5 past its deadline (nothing written), 6 token budget spent, 7 the key's own
--         requests/min, 8 the key's own concurrency. Every refusal but 5 is counted in
--         the minute, total and day rollups, by cause and per key.
-- Idempotent: a lease id that is already in KEYS[3] means this admission already ran (a
-- client resend after a lost reply), or was cancelled (a tombstone: score -expiry, left
-- by settle_request.lua for an admission whose client timed out): either way it is
-- answered as admitted and nothing is written or charged.
-- Behind prelude/tenant_generation.lua: refused, with nothing written, for a deleted tenant;
-- and prelude/budget_hold.lua (held_by, sweep_leases).

local PERIOD = 60000
local deadline = tonumber(ARGV[16])
if deadline > 0 then
  -- Redis < 7 replicates scripts verbatim unless told otherwise; TIME needs effects.
  if redis.replicate_commands then pcall(redis.replicate_commands) end
  local t = redis.call("TIME")
  if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > deadline then
    return {5, 0, 0, 0, 0, 0, ""}
  end
end
local now = tonumber(ARGV[1])

local holding = redis.call("EXISTS", KEYS[16]) == 1

-- Finished requests stop counting now, not when their batched settlement lands (which
-- under load comes about one request-duration later). Their ids move to KEYS[15] with
-- their expiry, so a settlement lost with its gateway is swept there by TTL too.
local n_vec = tonumber(ARGV[25] or "0")
local n_done = tonumber(ARGV[26 + n_vec] or "0")
local lease_ttl = tonumber(ARGV[7]) - now
if n_done > 0 then
  local latest = 0
  for i = 27 + n_vec, 26 + n_vec + n_done do
    local score = redis.call("ZSCORE", KEYS[3], ARGV[i])
    if score and tonumber(score) > now then
      redis.call("ZREM", KEYS[3], ARGV[i])
      redis.call("ZADD", KEYS[15], tonumber(score), ARGV[i])
      if tonumber(score) > latest then latest = tonumber(score) end
    end
  end
  -- While budget tokens are held, kept two lease TTLs past the latest expiry (a
  -- heartbeat, every sixth of one, sweeps it meanwhile): an entry must be swept, not
  -- forgotten, for its held tokens to go. Else a second past it.
  local keep = latest - now + (holding and 2 * lease_ttl or 1000)
  if latest > 0 and redis.call("PTTL", KEYS[15]) < keep then
    redis.call("PEXPIRE", KEYS[15], keep)
  end
end
if n_done > 0 or holding then sweep_leases(KEYS[15], KEYS[16], "-inf", now, holding) end
local rpm, tpm, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local conv, want_latch = ARGV[8], ARGV[9] == "1"

-- GCRA: state is the theoretical arrival time (TAT); admit while TAT stays within one period.
local function gcra(key, limit, n)
  local interval = PERIOD / limit
  local tat = tonumber(redis.call("GET", key) or now)
  if tat < now then tat = now end
  local new_tat = tat + n * interval
  local remaining_after = math.floor((now + PERIOD - new_tat) / interval)
  if new_tat - PERIOD > now then
    local left = math.floor((now + PERIOD - tat) / interval)
    return false, math.ceil(new_tat - PERIOD - now), left, math.ceil(tat - now), tat
  end
  return true, 0, remaining_after, math.ceil(new_tat - now), new_tat
end

local key_id = ARGV[18]
local rollup_ttl = tonumber(ARGV[24])
-- By status (5, late, is never counted): the causes of gateway/refusals.py, by status.
local CAUSES = {"rpm", "tpm", "concurrency", "latch", "", "budget", "key_rpm", "key_concurrency"}
local function reject(status, retry, rr, rreset, tr, treset)
  redis.call("HINCRBY", KEYS[4], "429", 1)
  redis.call("EXPIRE", KEYS[4], tonumber(ARGV[15]))
  redis.call("HINCRBY", KEYS[5], "429", 1)
  local field = "429:" .. CAUSES[status]
  redis.call("HINCRBY", KEYS[11], field, 1)
  if key_id ~= "" then redis.call("HINCRBY", KEYS[11], "k:" .. key_id .. ":" .. field, 1) end
  redis.call("EXPIRE", KEYS[11], rollup_ttl)
  return {status, retry, rr, rreset, tr, treset, ""}
end

-- The latch Redis holds for the conversation: the engine is told to expect exactly it.
local prev = ""
if conv ~= "" then prev = redis.call("HGET", KEYS[7], conv) or "" end

local function digest_of(name)
  return string.match(redis.call("HGET", KEYS[10], name) or "", '"digest":"(%x+)"') or ""
end

-- The names in a ledger entry (key_names.LatchEntry): a recorded one's
-- ("bytes:kind:digest:a,b") are the vectors its latch steers with; a pending one's
-- ("bytes:kind;a,b": a turn is storing a latch) those of the latch being stored and of
-- the one before it.
local function latch_names(info)
  return string.match(info, "^%d+:%a+:[^:]+:(.+)$") or string.match(info, "^%d+:%a+;(.+)$")
end
-- The current digests of the request's named vectors, then of the names in the
-- conversation's entry: the engine bridges only with the content Redis holds.
local function named_digests(out)
  for i = 1, n_vec do out[#out + 1] = digest_of(ARGV[25 + i]) end
  local refs = latch_names(prev)
  if refs then
    for name in string.gmatch(refs, "[^,]+") do out[#out + 1] = digest_of(name) end
  end
  return out
end

-- 0. A retry of an admission that already ran: admitted, nothing charged twice.
if redis.call("ZSCORE", KEYS[3], ARGV[6]) then
  local _, _, rr, rreset = gcra(KEYS[1], rpm, 0)
  local _, _, tr, treset = gcra(KEYS[2], tpm, 0)
  return named_digests({0, 0, rr, rreset, tr, treset, prev})
end

-- 1. Concurrency: expired leases (crashed gateways) and tombstones are swept first.
sweep_leases(KEYS[3], KEYS[16], 0, now, holding)
redis.call("ZREMRANGEBYSCORE", KEYS[3], "(" .. -now, 0)
local inflight = redis.call("ZCOUNT", KEYS[3], 0, "+inf")

-- 2. Rates (computed before any write, so a rejection leaves no trace in them).
local r_ok, r_retry, r_rem, r_reset, r_tat = gcra(KEYS[1], rpm, 1)
local t_ok, t_retry, t_rem, t_reset, t_tat = gcra(KEYS[2], tpm, cost)

-- The token budget: spent tokens of this UTC day or month (settled requests), and the
-- reservations of the requests still running: a burst cannot pass it all at once.
local budget = tonumber(ARGV[21])
if budget > 0 then
  local rollup = ARGV[22] == "month" and KEYS[12] or KEYS[11]
  local spent = tonumber(redis.call("HGET", rollup, "tokens") or "0")
  if spent + tonumber(redis.call("GET", KEYS[16]) or "0") >= budget then
    return reject(6, tonumber(ARGV[23]), r_rem, r_reset, t_rem, t_reset)
  end
end
if inflight >= tonumber(ARGV[5]) then
  return reject(3, 1000, r_rem, r_reset, t_rem, t_reset)
end
-- The key's own concurrency: its leases that the tenant still holds (a lease whose
-- settlement was lost expires from the tenant's set; it is dropped here).
local key_conc = tonumber(ARGV[20])
if key_conc > 0 and redis.call("ZCARD", KEYS[14]) >= key_conc then
  local live = 0
  for _, id in ipairs(redis.call("ZRANGE", KEYS[14], 0, -1)) do
    local sc = redis.call("ZSCORE", KEYS[3], id)
    if sc and tonumber(sc) > 0 then live = live + 1 else redis.call("ZREM", KEYS[14], id) end
  end
  if live >= key_conc then return reject(8, 1000, r_rem, r_reset, t_rem, t_reset) end
end
if not r_ok then return reject(1, r_retry, r_rem, r_reset, t_rem, t_reset) end
local key_rpm = tonumber(ARGV[19])
local k_ok, k_retry, k_rem, k_reset, k_tat = true, 0, 0, 0, 0
if key_rpm > 0 then
  k_ok, k_retry, k_rem, k_reset, k_tat = gcra(KEYS[13], key_rpm, 1)
  if not k_ok then return reject(7, k_retry, k_rem, k_reset, t_rem, t_reset) end
  -- The caller sees the tighter of its key's and its tenant's request budgets.
  if k_rem < r_rem then r_rem, r_reset = k_rem, k_reset end
end
if not t_ok then return reject(2, t_retry, r_rem, r_reset, t_rem, t_reset) end

-- A latch naming a vector the tenant lacks is refused by the gateway after this call
-- (400 unknown_vector, from the "" digest returned): no latch is planned for it, so it
-- evicts nothing and leaves the conversation's ledger entry as it is.
if want_latch then
  for i = 1, n_vec do
    if digest_of(ARGV[25 + i]) == "" then want_latch = false break end
  end
end

-- 3. Latch quota: plan evictions (own LRU latches only) before writing anything.
local evicted = {}
local evicted_info = {}  -- victim -> its ledger entry, as planned on
-- A recorded latch's entry has its digest ("bytes:kind:digest"); a pending one has not.
local function recorded(info) return string.match(info, "^%d+:%a+:") ~= nil end
local new_total = 0
local reserve = 0
if conv ~= "" and want_latch then
  local nbytes, max_count, max_bytes = tonumber(ARGV[10]), tonumber(ARGV[12]), tonumber(ARGV[13])
  local prev_bytes = tonumber(string.match(prev, "^(%d+)") or "0")
  local count = redis.call("ZCARD", KEYS[6]) - (prev ~= "" and 1 or 0)
  local total = tonumber(redis.call("GET", KEYS[8]) or "0") - prev_bytes
  -- Held until the turn settles: the larger of the new latch and the one it replaces,
  -- since a failed turn puts the old one back (settle_request.lua "restore"); room a
  -- shrinking turn frees is not another conversation's until the new latch is kept
  -- (keep_latch.lua then sets the exact size).
  reserve = math.max(nbytes, prev_bytes)
  nbytes = reserve
  if count + 1 > max_count or total + nbytes > max_bytes then
    -- Abandoned "being stored" entries (their turn's gateway died, or its settlement
    -- came too late to count) are not latches: reclaim them before any policy applies.
    local idle = redis.call("ZRANGEBYSCORE", KEYS[6], "-inf", now - tonumber(ARGV[17]))
    for _, victim in ipairs(idle) do
      if count + 1 <= max_count and total + nbytes <= max_bytes then break end
      local info = redis.call("HGET", KEYS[7], victim) or "0"
      if victim ~= conv and not recorded(info) then
        total = total - tonumber(string.match(info, "^(%d+)") or "0")
        count = count - 1
        evicted[#evicted + 1] = victim
        evicted_info[victim] = info
      end
    end
  end
  if tonumber(ARGV[10]) > max_bytes or max_count < 1 then
    return reject(4, 60000, r_rem, r_reset, t_rem, t_reset)
  end
  if count + 1 > max_count or total + nbytes > max_bytes then
    if ARGV[14] == "reject" then return reject(4, 1000, r_rem, r_reset, t_rem, t_reset) end
    local lru = redis.call("ZRANGE", KEYS[6], 0, -1)
    for _, victim in ipairs(lru) do
      if count + 1 <= max_count and total + nbytes <= max_bytes then break end
      if victim ~= conv and not evicted_info[victim] then
        local info = redis.call("HGET", KEYS[7], victim) or "0"
        total = total - tonumber(string.match(info, "^(%d+)") or "0")
        count = count - 1
        evicted[#evicted + 1] = victim
        evicted_info[victim] = info
      end
    end
  end
  new_total = total + nbytes
end

-- 4. Commit.
local saved = {}
redis.call("SET", KEYS[1], r_tat, "PX", math.ceil(r_tat - now) + 1000)
redis.call("SET", KEYS[2], t_tat, "PX", math.ceil(t_tat - now) + 1000)
redis.call("ZADD", KEYS[3], tonumber(ARGV[7]), ARGV[6])
-- Only ever lengthened: a gateway with a shorter lease TTL must not cut others' leases.
local leases_ttl = lease_ttl + 1000
if redis.call("PTTL", KEYS[3]) < leases_ttl then redis.call("PEXPIRE", KEYS[3], leases_ttl) end
local hold = held_by(ARGV[6])
if hold > 0 then redis.call("INCRBY", KEYS[16], hold) end
if hold > 0 or redis.call("EXISTS", KEYS[16]) == 1 then
  redis.call("PEXPIRE", KEYS[16], redis.call("PTTL", KEYS[3]))
end
redis.call("HINCRBY", KEYS[4], "requests", 1)
redis.call("EXPIRE", KEYS[4], tonumber(ARGV[15]))
redis.call("HINCRBY", KEYS[5], "requests", 1)
redis.call("HINCRBY", KEYS[11], "requests", 1)
redis.call("HINCRBY", KEYS[12], "requests", 1)
redis.call("EXPIRE", KEYS[12], rollup_ttl)
if key_id ~= "" then
  redis.call("HINCRBY", KEYS[11], "k:" .. key_id .. ":requests", 1)
  if key_rpm > 0 then redis.call("SET", KEYS[13], k_tat, "PX", math.ceil(k_tat - now) + 1000) end
  if key_conc > 0 then
    redis.call("ZADD", KEYS[14], now, ARGV[6])
    redis.call("PEXPIRE", KEYS[14], tonumber(ARGV[7]) - now + 86400000)
  end
end
redis.call("EXPIRE", KEYS[11], rollup_ttl)
if conv ~= "" then
  if want_latch then
    for _, victim in ipairs(evicted) do
      local info = evicted_info[victim]
      local spec = recorded(info) and redis.call("HGET", KEYS[9], victim)
      if spec then
        saved[#saved + 1] = redis.call("ZSCORE", KEYS[6], victim)
        saved[#saved + 1] = info
        saved[#saved + 1] = spec
      else
        saved[#saved + 1] = ""
        saved[#saved + 1] = ""
        saved[#saved + 1] = ""
      end
      redis.call("ZREM", KEYS[6], victim)
      redis.call("HDEL", KEYS[7], victim)
      redis.call("HDEL", KEYS[9], victim)
    end
    redis.call("ZADD", KEYS[6], now, conv)
    -- Pending, with the names of this latch (the request's) and of the one it replaces.
    local names, seen = {}, {}
    for i = 1, n_vec do
      if not seen[ARGV[25 + i]] then seen[ARGV[25 + i]] = true names[#names + 1] = ARGV[25 + i] end
    end
    for name in string.gmatch(latch_names(prev) or "", "[^,]+") do
      if not seen[name] then seen[name] = true names[#names + 1] = name end
    end
    local pending = reserve .. ":" .. ARGV[11]
    if #names > 0 then pending = pending .. ";" .. table.concat(names, ",") end
    redis.call("HSET", KEYS[7], conv, pending)
    redis.call("SET", KEYS[8], new_total)
  else
    redis.call("ZADD", KEYS[6], "XX", now, conv)  -- recency refresh, only if latched
  end
end
local out = named_digests({0, 0, r_rem, r_reset, t_rem, t_reset, prev})
out[#out + 1] = #evicted
for _, victim in ipairs(evicted) do out[#out + 1] = victim end
for _, item in ipairs(saved) do out[#out + 1] = item end
return out
