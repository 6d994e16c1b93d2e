-- The budget of one dataset: admission, exactly-once counting and the row hand-off, atomically.
--
-- KEYS[1] budget   HASH   limit, kept (tokens of kept rows), kept_sq (sum of their squares),
--                         reserved (estimates of admitted requests), rows (kept rows),
--                         state: active | exhausted | stopped
-- KEYS[2] done     SET    prompt ids whose row was kept: the exactly-once guard
-- KEYS[3] leases   HASH   prompt id -> "<lease>|<estimate>|<expires_ms>" of admitted requests
-- KEYS[4] failed   HASH   prompt id -> JSON {reason, attempts, detail}
-- KEYS[5] results  STREAM kept rows, fields: id <prompt id>, row <msgpack row>
-- KEYS[6] halt     STRING set when OpenRouter refused the account (bad key, no credits): nothing
--                         is admitted anywhere until the producer clears it
--
-- ARGV[1] is the operation; the rest depends on it:
--   reserve  id lease now_ms ttl_ms prior_estimate prior_weight trust_rows
--            -> {"ok", estimate} | {"done"} (kept, or failed in this run) | {"stopped"} | {"busy", ms_left} | {"over", estimate}
--               | {"wait", estimate}  (full for now: ask again when in-flight requests have landed)
--               | {"halted"}          (the account was refused; the prompt keeps no outcome)
--            Admits a request only if kept + in-flight × estimate + estimate fits under limit; the first
--            request that does not fit turns the dataset "exhausted", which stops admission for
--            everyone (the producer then purges the queue). Requests already admitted still land:
--            their holder calls reserve again before each retry, which renews the lease (ttl_ms
--            covers one attempt) and works while exhausted; only "stopped" ends them.
--   settle   id lease tokens row  -> {"kept", kept, limit} | {"duplicate"}
--            Counts a kept row and hands it to the collector in the same step, so a prompt is
--            counted and written once even when Celery delivers it twice.
--   fail     id lease failure_json -> {"failed"} | {"duplicate"}
--   release  id lease             -> {"released"}   (give back an admission, no outcome)
--   reap     now_ms               -> {"reaped", n}  (expired leases of killed workers)
--   open     limit                -> {"open", kept, rows}   (start or resume the dataset)
--   close                         -> {"closed"}
local budget, done, leases, failed, results, halt = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local op = ARGV[1]

local function parse_lease(raw)
  local lease, est, exp = string.match(raw, "^(.*)|(%d+)|(%d+)$")
  return lease, tonumber(est), tonumber(exp)
end

-- Drops the lease of `id` if it belongs to `lease` (or to anyone, when `lease` is false);
-- its estimate leaves `reserved`.
local function drop_lease(id, lease)
  local raw = redis.call("HGET", leases, id)
  if not raw then return end
  local holder, est = parse_lease(raw)
  if lease and holder ~= lease then return end
  redis.call("HDEL", leases, id)
  redis.call("HINCRBY", budget, "reserved", -est)
end

if op == "reserve" then
  local id, lease = ARGV[2], ARGV[3]
  local now, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
  local prior, prior_weight, trust_rows = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  if redis.call("SISMEMBER", done, id) == 1 then return {"done"} end
  -- A failure is final for this run (the next run clears `failed` and asks again): a stray second
  -- delivery (a restored message after a Redis restart) must not pay for the prompt again.
  if redis.call("HEXISTS", failed, id) == 1 then return {"done"} end
  if redis.call("EXISTS", halt) == 1 then
    drop_lease(id, lease)
    return {"halted"}
  end
  local state = redis.call("HGET", budget, "state")
  if state ~= "active" and state ~= "exhausted" then return {"stopped"} end
  local raw = redis.call("HGET", leases, id)
  if raw then
    local holder, est, exp = parse_lease(raw)
    if holder == lease then
      -- The holder renews before each retry: a lease only has to outlive one attempt.
      redis.call("HSET", leases, id, lease .. "|" .. est .. "|" .. (now + ttl))
      return {"ok", est}
    end
    if exp > now then return {"busy", exp - now} end
    drop_lease(id, false)  -- its holder died: take its place
  end
  if state ~= "active" then return {"stopped"} end
  local b = redis.call("HMGET", budget, "limit", "kept", "rows", "kept_sq")
  local limit, kept, rows = tonumber(b[1]), tonumber(b[2] or "0"), tonumber(b[3] or "0")
  local kept_sq = tonumber(b[4] or "0")
  -- The prior counts as `weight` rows of its own size, so the estimate starts at the prior (the
  -- length class's max_tokens unless configured: a first wave can't overshoot) and moves to the
  -- measured mean as rows are kept. While fewer rows have landed than are in flight, the landed
  -- ones are the quick, short answers: the prior weighs as the excess.
  local in_flight = redis.call("HLEN", leases)
  local weight = math.max(prior_weight, in_flight - rows)
  local estimate = math.ceil((prior * weight + kept) / (weight + rows))
  -- Requests still in flight are the long ones (an answer stays in flight in proportion to its
  -- length), so they are projected with the length-biased mean sum(x^2)/sum(x), not the mean:
  -- with the plain mean a dataset overshot its budget by ~5% in the demo.
  local in_flight_each = math.ceil((prior * prior * weight + kept_sq) / (prior * weight + kept))
  local projected = in_flight * in_flight_each
  if kept + projected + estimate > limit then
    -- Full. Final once nothing in flight could make room (kept alone leaves none) or once the
    -- estimate rests on enough rows to trust the projection (at least trust_rows, and no fewer
    -- than are in flight); before that, in-flight requests projected with a prior-heavy estimate
    -- may land smaller: wait for them.
    if kept + estimate > limit or (rows >= trust_rows and rows >= in_flight) then
      redis.call("HSET", budget, "state", "exhausted")
      return {"over", estimate}
    end
    return {"wait", estimate}
  end
  redis.call("HSET", leases, id, lease .. "|" .. estimate .. "|" .. (now + ttl))
  redis.call("HINCRBY", budget, "reserved", estimate)
  return {"ok", estimate}

elseif op == "settle" then
  local id, lease, tokens, row = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
  drop_lease(id, lease)
  if redis.call("SADD", done, id) == 0 then return {"duplicate"} end
  local kept = redis.call("HINCRBY", budget, "kept", tokens)
  redis.call("HINCRBY", budget, "rows", 1)
  redis.call("HINCRBY", budget, "kept_sq", tokens * tokens)
  redis.call("HDEL", failed, id)
  redis.call("XADD", results, "*", "id", id, "row", row)
  return {"kept", kept, tonumber(redis.call("HGET", budget, "limit"))}

elseif op == "fail" then
  local id, lease, failure = ARGV[2], ARGV[3], ARGV[4]
  drop_lease(id, lease)
  if redis.call("SISMEMBER", done, id) == 1 then return {"duplicate"} end
  redis.call("HSET", failed, id, failure)
  return {"failed"}

elseif op == "release" then
  drop_lease(ARGV[2], ARGV[3])
  return {"released"}

elseif op == "reap" then
  local now, n = tonumber(ARGV[2]), 0
  local all = redis.call("HGETALL", leases)
  for i = 1, #all, 2 do
    local _, _, exp = parse_lease(all[i + 1])
    if exp <= now then
      drop_lease(all[i], false)
      n = n + 1
    end
  end
  return {"reaped", n}

elseif op == "open" then
  -- `reserved` is re-derived from the leases so a crash between two writes can't leak budget.
  local reserved = 0
  local all = redis.call("HGETALL", leases)
  for i = 2, #all, 2 do
    local _, est = parse_lease(all[i])
    reserved = reserved + est
  end
  redis.call("HSET", budget, "limit", ARGV[2], "state", "active", "reserved", reserved)
  redis.call("HSETNX", budget, "kept", 0)
  redis.call("HSETNX", budget, "rows", 0)
  redis.call("HSETNX", budget, "kept_sq", 0)
  local b = redis.call("HMGET", budget, "kept", "rows")
  return {"open", tonumber(b[1]), tonumber(b[2])}

elseif op == "close" then
  redis.call("HSET", budget, "state", "stopped")
  return {"closed"}
end

return redis.error_reply("budget.lua: unknown operation " .. tostring(op))
