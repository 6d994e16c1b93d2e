-- The fleet-wide throttle: how many upstream requests every worker of every host may have in flight
-- together, how many may start per second, and the adaptive limit that 429s cut and successes grow.
--
-- Rate limits are the account's, not a worker's (openrouter.md: per model, global to the account):
-- greenlets backing off one by one leave half of what a provider would serve unused, and every worker
-- added adds 429s. Here the whole fleet shares one limit and one pause.
--
-- KEYS[1] state  HASH   limit       current in-flight limit (float; absent: max_in_flight)
--                       pause_ms    unix ms before which nobody starts a request (Retry-After)
--                       cut_ms      unix ms the current congestion event began
--                       event_limit, event_in_flight, event_throttled   the limit and the requests
--                                   in flight when it began, and how many the provider refused since
--                       tokens, tokens_ms   the requests-per-second bucket (of one) and when it was filled
--                       ok, throttled       answers counted by kind (for progress and metrics)
--                       cap         the run's max_in_flight, for readers (workers pass theirs)
-- KEYS[2] slots  ZSET   slot id -> expiry unix ms: requests in flight; a dead worker's slots expire
--
-- ARGV[1] is the operation:
--   acquire  now_ms ttl_ms max_in_flight max_per_s slot [slot ...]
--            -> {"ok", granted, limit} | {"wait", ms, why}   why: pause | limit | rate
--            grants the first ``granted`` slots (at least one; as many as the limit and the rate
--            allow): a process's queue of waiting requests is served in one call, not one each.
--            max_in_flight 0: no fixed cap (the adaptive limit alone, unbounded until a 429);
--            max_per_s 0: no rate cap.
--   release  slot now_ms outcome retry_after_ms max_in_flight beta min_limit cut_gap_ms grow_near
--            outcome: ok | throttled | refused | other -> {"released", limit}
--            (refused: a 429 with adaptive back-off off; counted as throttled, no cut, no pause)
--            ok grows the limit by 1/limit (one more request per round trip: additive increase) while
--            the fleet uses its limit (in flight >= grow_near x limit, or within one of it);
--            throttled (429/503) begins a congestion event unless one began less than cut_gap_ms ago,
--            and cuts the limit to beta x what the provider served during it (see below); a
--            Retry-After pauses every new request of the fleet until then.
--   state    now_ms -> {limit, in_flight, pause_ms_left, ok, throttled, cap}
--   reset    max_in_flight -> "reset": a new run learns from scratch (slots in flight stay)
local state, slots = KEYS[1], KEYS[2]
local op = ARGV[1]
local UNBOUNDED = 1e9

local function current_limit(max_in_flight)
  local limit = tonumber(redis.call("HGET", state, "limit"))
  local cap = max_in_flight > 0 and max_in_flight or UNBOUNDED
  if not limit or limit > cap then limit = cap end
  return limit
end

if op == "acquire" then
  local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
  local max_in_flight, max_per_s = tonumber(ARGV[4]), tonumber(ARGV[5])
  local wanted = #ARGV - 5  -- slot ids: ARGV[6], ARGV[7] ...
  redis.call("ZREMRANGEBYSCORE", slots, "-inf", now)
  local pause = tonumber(redis.call("HGET", state, "pause_ms") or "0")
  if pause > now then return {"wait", pause - now, "pause"} end
  local limit = current_limit(max_in_flight)
  local grant = math.min(wanted, math.max(1, math.floor(limit)) - redis.call("ZCARD", slots))
  if grant < 1 then return {"wait", 0, "limit"} end
  if max_per_s > 0 then
    -- A bucket of one: requests start at least 1/max_per_s apart, so no one-second window holds
    -- more than max_per_s + 1 of them (a bucket of max_per_s would let 2 x max_per_s through in
    -- the first second, which a provider counting per second answers with 429s).
    local b = redis.call("HMGET", state, "tokens", "tokens_ms")
    local tokens, at = tonumber(b[1] or "1"), tonumber(b[2] or now)
    tokens = math.min(1, tokens + (now - at) * max_per_s / 1000)
    grant = math.min(grant, math.floor(tokens))
    if grant < 1 then
      redis.call("HSET", state, "tokens", tostring(tokens), "tokens_ms", now)
      return {"wait", math.ceil((1 - tokens) * 1000 / max_per_s), "rate"}
    end
    redis.call("HSET", state, "tokens", tostring(tokens - grant), "tokens_ms", now)
  end
  for i = 1, grant do redis.call("ZADD", slots, now + ttl, ARGV[5 + i]) end
  return {"ok", grant, tostring(limit)}

elseif op == "release" then
  local slot, now, outcome = ARGV[2], tonumber(ARGV[3]), ARGV[4]
  local retry_after, max_in_flight = tonumber(ARGV[5]), tonumber(ARGV[6])
  local beta, min_limit, cut_gap = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
  local grow_near = tonumber(ARGV[10])
  local in_flight = redis.call("ZCARD", slots)
  -- A slot that expired (or was never ours) must not count as an answer: its request's fate is
  -- already out of the in-flight count the limit is compared with.
  if redis.call("ZREM", slots, slot) == 0 then outcome = "other" end
  local limit = current_limit(max_in_flight)
  if outcome == "ok" then
    redis.call("HINCRBY", state, "ok", 1)
    -- Grow only while the limit is what holds the fleet back: a fleet with fewer greenlets than
    -- its limit would otherwise raise it without bound, and the next 429 would find it meaningless.
    -- "At the limit" with a margin: slots freed in one process are refilled by another only after
    -- its next poll, so a busy fleet sits a few requests under its limit most of the time.
    if limit < UNBOUNDED and in_flight >= math.min(math.floor(limit) - 1, grow_near * limit) then
      local cap = max_in_flight > 0 and max_in_flight or UNBOUNDED
      limit = math.min(cap, limit + 1 / limit)
      redis.call("HSET", state, "limit", tostring(limit))
    end
  elseif outcome == "refused" then  -- a 429 while adaptive back-off is off: counted, nothing more
    redis.call("HINCRBY", state, "throttled", 1)
  elseif outcome == "throttled" then
    redis.call("HINCRBY", state, "throttled", 1)
    -- What the provider serves is what was in flight when the event began minus what it refused:
    -- each refusal of the event lowers the estimate by one. A fleet starting unbounded with 1,500
    -- requests against a capacity of 300 thus lands near 0.9 x 300 in one event, not after fifteen
    -- 10% cuts; at steady state (one request over the capacity) it is the plain 0.9 x cut.
    local e = redis.call("HMGET", state, "cut_ms", "event_limit", "event_in_flight", "event_throttled")
    local cut, event_limit = tonumber(e[1] or "0"), tonumber(e[2] or "0")
    local event_in_flight, refused = tonumber(e[3] or "0"), tonumber(e[4] or "0")
    if now - cut >= cut_gap then  -- a new event: one congestion, however many 429s, cuts once
      cut, event_limit, event_in_flight, refused = now, limit, in_flight, 0
    end
    refused = refused + 1
    local served = math.min(event_limit, event_in_flight - refused)
    limit = math.min(limit, math.max(min_limit, math.floor(served * beta)))
    redis.call("HSET", state, "limit", tostring(limit), "cut_ms", cut, "event_limit", tostring(event_limit),
               "event_in_flight", event_in_flight, "event_throttled", refused)
    if retry_after > 0 then
      local pause = tonumber(redis.call("HGET", state, "pause_ms") or "0")
      if now + retry_after > pause then redis.call("HSET", state, "pause_ms", now + retry_after) end
    end
  end
  return {"released", tostring(limit)}

elseif op == "state" then
  local now = tonumber(ARGV[2])
  redis.call("ZREMRANGEBYSCORE", slots, "-inf", now)
  local s = redis.call("HMGET", state, "limit", "pause_ms", "ok", "throttled", "cap")
  return {s[1] or "", redis.call("ZCARD", slots), math.max(0, tonumber(s[2] or "0") - now),
          tonumber(s[3] or "0"), tonumber(s[4] or "0"), s[5] or ""}

elseif op == "reset" then
  local cap = tonumber(ARGV[2])
  redis.call("DEL", state)
  if cap > 0 then redis.call("HSET", state, "cap", cap) end
  return "reset"
end

return redis.error_reply("throttle.lua: unknown operation " .. tostring(op))
