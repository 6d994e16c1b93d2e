-- The fleet-wide throttle: how many upstream requests every worker of every host may have in flight
-- together, how many may start per second, and the adaptive limit that congestion cuts and answers grow.
--
-- Rate limits are the account's, not a worker's (openrouter.md: per model, global to the account):
-- greenlets backing off one by one leave half of what a provider would serve unused, and every worker
-- added adds 429s. Here the whole fleet shares one limit and one pause.
--
-- Not every 429 is congestion. A provider may refuse a share of requests whatever the load (an
-- upstream of OpenRouter rate-limited on its own, a flaky route): AIMD reading those as congestion
-- cuts again and again and holds the fleet at its floor. So a 429 begins a congestion event (a cut
-- and a fleet-wide pause) only when the 429 share of recent requests stands above the background
-- share (the share that persists whatever the load) by more than chance. Each cut is then checked: if the
-- share after it has not fallen (to under check_ratio x what it was), the 429s were not about load,
-- the cut is undone and that share becomes the background. The background fades (half-life), so a
-- provider that stops refusing at random is watched closely again. A background 429 only delays its
-- own request (its Retry-After, workers/pipeline/retry.py).
--
-- Two limits, kept apart, and the fleet admits under the lower (and the run's cap):
--   the capacity window (``limit``) bounds requests in flight as the provider serves them: AIMD, cut
--     by congestion 429s, grown back by answers while it is what holds the fleet;
--   the balance bound (``balance_limit``) bounds them in dollars, as worst cases the account's
--     balance covers (the in-flight budget): set from the plan's balance, cut by the account's 402s,
--     and shrunk only by what each answer really took off the balance (its drain).
-- Before, one figure served both: once the balance was known, a 429's cut left a limit that every
-- answer drained and only 1/limit grew, and a capacity limit met a balance rule: the fleet sank to
-- its floor of 4-5 in flight for good (issue 36: 2,097 of 4,000 prompts kept in 397 s).
--
-- KEYS[1] state  HASH   limit       the capacity window (float; absent: unbounded, until a 429 cuts it)
--                       balance_limit   the balance bound in worst-case requests (float; absent: unknown)
--                       pause_ms    unix ms before which nobody starts a request (Retry-After)
--                       cut_ms      unix ms the current congestion event began
--                       event_limit, event_in_flight, event_throttled   the limit and the requests
--                                   in flight when it began, and how many the provider refused since
--                       bcut_ms, bevent_limit, bevent_in_flight, bevent_refused   the same for the
--                                   account's current balance event (402 in_flight_budget_exhausted)
--                       win_ms, win_started, win_thr, prev_started, prev_thr   requests started and
--                                   429s in the current and the previous window of window_ms: the
--                                   recent share
--                       bg, bg_ms   the background 429 share and when it was measured
--                       check_ms, check_limit, check_share, check_started, check_thr   the check of
--                                   the last cut: requests and 429s counted from check_ms, the limit
--                                   before the cut and the share that made it
--                       tokens, tokens_ms   the requests-per-second bucket (of one) and when it was filled
--                       ok, throttled, budget   answers counted by kind (for progress and metrics)
--                       cap         the run's max_in_flight, for readers (workers pass theirs)
--                       hold        present while the producer's plan is still counting: nobody
--                                   starts a request (prompts are queued and prepared meanwhile)
--                       want_ms     unix ms until which a process within its share wanted a slot
--                                   and found none: no borrowing (acquire, keep_free) until then
-- KEYS[2] slots  ZSET   slot id -> expiry unix ms: requests in flight; a dead worker's slots expire
--
-- ARGV[1] is the operation:
--   acquire  now_ms ttl_ms max_in_flight max_per_s window_ms keep_free slot [slot ...]
--            -> {"ok", granted, limit} | {"wait", ms, why}   why: hold | pause | limit | rate
--            grants the first ``granted`` slots (at least one; as many as the limit and the rate
--            allow): a process's queue of waiting requests is served in one call, not one each.
--            max_in_flight 0: no fixed cap (the adaptive limit alone, unbounded until a cut);
--            max_per_s 0: no rate cap. keep_free: slots to leave free under the limit (a process
--            over its own share borrowing what others leave unused keeps a few for them; else 0).
--            A process within its share that finds no slot marks the fleet wanting (want_ms, for
--            WANT_MS): meanwhile nobody borrows, so every slot freed goes to a share.
--   release  now_ms beta min_limit cut_gap_ms grow_near window_ms min_requests margin bg_max
--            bg_half_life_ms noise_z check_requests check_ratio wanting
--            then per slot given back: slot outcome retry_after_ms max_in_flight ttl_ms drain
--            (ttl_ms: the slot's, as acquired; drain: an answer's cost over its request's worst case)
--            -> {"released", limit after the last}
--            A process's answers of the moment come back in one call, in the order given.
--            wanting "1": the process giving them back is then under its share with requests
--            waiting; it marks the fleet wanting (as a vain acquire does), so no borrower takes
--            these slots in the moment before that process asks for them again.
--            outcome: ok | throttled | budget | refused | other
--            (refused: a 429 with adaptive back-off off; counted as throttled, nothing more)
--            budget: the account's in-flight budget refused the request (a 402 with Retry-After):
--            too much in flight for the balance. Not a share to judge against a background: the
--            account says so of every request over it, so it always cuts (one event per
--            cut_gap_ms, as a 429's) and pauses the fleet for its Retry-After; never checked or undone.
--            From then on (or from a reset with a start: the balance's fit) the limit is balance-bound:
--            each ok answer spent ``drain`` worst cases of the balance, so the limit shrinks by as much
--            (what fits in flight shrinks as the run spends) before it may grow by 1/limit.
--            ok grows the limit by 1/limit (one more request per round trip: additive increase) while
--            the fleet uses its limit (in flight >= grow_near x limit, or within one of it);
--            throttled (429/503) is congestion when the recent share (of at least min_requests)
--            exceeds the background by more than chance (noise_z standard deviations of a binomial
--            share of that many requests, at least margin), no event began less than cut_gap_ms
--            ago and no cut is being checked: it cuts the limit to beta x what the provider served
--            during the event (see below), and a Retry-After pauses every new request of the fleet.
--   state    now_ms bg_half_life_ms -> {limit, in_flight, pause_ms_left, ok, throttled, cap, background_share,
--            budget, capacity, balance}   limit: the lower of the two (and "" for neither); capacity,
--            balance: each on its own ("" where unbounded or unknown)
--   reset    max_in_flight hold start -> "reset": a new run learns from scratch (slots in flight stay);
--            hold "1": no request starts until "unhold" (the run's plan has not passed yet);
--            start > 0: the balance bound starts there (what the account's balance covers); the
--            capacity window starts unbounded either way
--   unhold   -> "unheld": the plan passed, requests may start
local state, slots = KEYS[1], KEYS[2]
local op = ARGV[1]
local UNBOUNDED = 1e9

-- The capacity window and the balance bound, each UNBOUNDED where none is set.
local function bounds()
  local b = redis.call("HMGET", state, "limit", "balance_limit")
  return tonumber(b[1] or UNBOUNDED), tonumber(b[2] or UNBOUNDED)
end

-- What the fleet may have in flight: the lower of the two limits and the run's cap.
local function current_limit(max_in_flight)
  local capacity, balance = bounds()
  local cap = max_in_flight > 0 and max_in_flight or UNBOUNDED
  return math.min(capacity, balance, cap)
end

-- The recent share counts requests by when they started: 429s of the requests started in this
-- window and the previous one, over those requests. Counted when they arrive instead, a fleet's
-- first second would be all 429s (back in milliseconds, while the answers of the same requests take
-- seconds), and so would the second after every pause (nothing starts, earlier 429s still arrive).
-- ``started_at``: the refused request's start (0 for none). A refusal of a request older than both
-- windows counts in the previous one: on a starved host a 429 can take seconds from the slot's grant
-- to its release here, and left out, every such refusal vanished from the share: the fleet ran
-- unbounded at 60% 429s for two minutes (bench/throttle_run.py beside three CPU burners).
local function count_window(now, window, started, refused, started_at)
  local w = redis.call("HMGET", state, "win_ms", "win_started", "win_thr", "prev_started", "prev_thr")
  local at = tonumber(w[1] or now)
  local win_started, win_thr = tonumber(w[2] or "0"), tonumber(w[3] or "0")
  local prev_started, prev_thr = tonumber(w[4] or "0"), tonumber(w[5] or "0")
  if now - at >= 2 * window then
    at, prev_started, prev_thr, win_started, win_thr = now, 0, 0, 0, 0
  elseif now - at >= window then
    at, prev_started, prev_thr, win_started, win_thr = at + window, win_started, win_thr, 0, 0
  end
  win_started = win_started + started
  if refused > 0 then
    if started_at >= at then win_thr = win_thr + refused
    else prev_thr = prev_thr + refused end
  end
  redis.call("HSET", state, "win_ms", at, "win_started", win_started, "win_thr", win_thr,
             "prev_started", prev_started, "prev_thr", prev_thr)
  return win_started + prev_started, win_thr + prev_thr
end

-- Each limit's events, by the hash fields that record them: the limit cut, when its event began,
-- the fleet's limit and in-flight count then, and how many refusals the event has had.
local CAPACITY = {limit = "limit", cut = "cut_ms", limit_then = "event_limit", in_flight_then = "event_in_flight",
                  refused = "event_throttled"}
local BALANCE = {limit = "balance_limit", cut = "bcut_ms", limit_then = "bevent_limit",
                 in_flight_then = "bevent_in_flight", refused = "bevent_refused"}

-- The event of ``kind`` on record: when it began, the limit and the in-flight count then, and how
-- many refusals it has had.
local function event_of(kind)
  local e = redis.call("HMGET", state, kind.cut, kind.limit_then, kind.in_flight_then, kind.refused)
  return tonumber(e[1] or "0"), tonumber(e[2] or "0"), tonumber(e[3] or "0"), tonumber(e[4] or "0")
end

-- One more refusal of the event of ``kind`` that began at cut: what is served is what was in flight
-- when the event began less what it refused since, and that kind's limit falls to beta x that (never
-- below min_limit, never up); a Retry-After pauses every new request of the fleet. Returns the
-- fleet's limit after it (the lower of the two, and the cap).
local function cut_in_event(kind, max_in_flight, cut, event_limit, event_in_flight, refused, beta, min_limit, now,
                            retry_after)
  refused = refused + 1
  local served = math.min(event_limit, event_in_flight - refused)
  local own = tonumber(redis.call("HGET", state, kind.limit) or UNBOUNDED)
  own = math.min(own, math.max(min_limit, math.floor(served * beta)))
  redis.call("HSET", state, kind.limit, tostring(own), kind.cut, cut, kind.limit_then, tostring(event_limit),
             kind.in_flight_then, event_in_flight, kind.refused, refused)
  if retry_after > 0 then
    local pause = tonumber(redis.call("HGET", state, "pause_ms") or "0")
    if now + retry_after > pause then redis.call("HSET", state, "pause_ms", now + retry_after) end
  end
  return current_limit(max_in_flight)
end

-- One slot given back with its outcome; the policy is read from ARGV[3..14] (see "release").
-- Returns the limit after it.
local function release_one(slot, now, outcome, retry_after, max_in_flight, ttl, drain)
  local beta, min_limit, cut_gap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local grow_near, window, min_requests = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
  local margin, bg_max, bg_half_life = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
  local noise_z, check_requests, check_ratio = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
  local in_flight = redis.call("ZCARD", slots)
  local expiry = tonumber(redis.call("ZSCORE", slots, slot) or "0")
  -- A slot that expired (or was never ours) must not count as an answer: its request's fate is
  -- already out of the in-flight count the limit is compared with.
  if redis.call("ZREM", slots, slot) == 0 then outcome = "other" end
  local started_at = expiry - ttl
  local limit = current_limit(max_in_flight)
  if outcome == "other" then return limit end  -- says nothing about capacity

  if outcome == "budget" then
    redis.call("HINCRBY", state, "budget", 1)
    -- The account's word, not a share: every refusal belongs to an event (a new one after cut_gap)
    -- whose estimate of what the balance carries is what was in flight when it began, less what it
    -- refused since, as for congestion below.
    -- It cuts the balance bound alone: the provider's capacity says nothing about dollars.
    local cut, event_limit, event_in_flight, refused = event_of(BALANCE)
    if now - cut >= cut_gap then cut, event_limit, event_in_flight, refused = now, limit, in_flight, 0 end
    return cut_in_event(BALANCE, max_in_flight, cut, event_limit, event_in_flight, refused, beta, min_limit, now,
                        retry_after)
  end
  redis.call("HINCRBY", state, outcome == "ok" and "ok" or "throttled", 1)
  if outcome == "refused" then return limit end  -- adaptive back-off is off
  local refusal = outcome == "throttled" and 1 or 0
  local started, refused_recently = count_window(now, window, 0, refusal, started_at)

  local c = redis.call("HMGET", state, "check_ms", "check_limit", "check_share", "check_started", "check_thr",
                       "bg", "bg_ms")
  local check_ms = tonumber(c[1] or "0")
  local bg = tonumber(c[6] or "0") * 0.5 ^ ((now - tonumber(c[7] or now)) / bg_half_life)
  if check_ms > 0 and now >= check_ms then
    -- The check of the last cut: did the share fall once the fleet carried less?
    -- Only requests started after check_ms: the cut's effect, not the 429s it answered.
    local check_started = tonumber(c[4] or "0")
    local check_thr = tonumber(c[5] or "0") + (started_at >= check_ms and refusal or 0)
    redis.call("HSET", state, "check_thr", check_thr)
    if check_started >= check_requests and now >= check_ms + window then
      -- What is left of the share once the cut took effect is the background: all of it when the
      -- cut did not help, the part no cut can help when it did.
      local after = check_thr / math.max(1, check_started)
      -- Above bg_max the cut was too small (a burst judged before all of it had started) or the
      -- provider is in trouble: the cut stays, nothing is learned, and the next 429 may cut again.
      if after <= bg_max then
        bg = after
        redis.call("HSET", state, "bg", tostring(bg), "bg_ms", now)
        if after >= check_ratio * tonumber(c[3]) then
          -- The cut did not lower the share: those 429s come whatever the load. Undo it (the
          -- capacity window; the balance bound is the account's word, not the cut's).
          local capacity = math.max(bounds(), tonumber(c[2]))
          if capacity >= UNBOUNDED then redis.call("HDEL", state, "limit")  -- unbounded again, as before the cut
          else redis.call("HSET", state, "limit", tostring(capacity)) end
          limit = current_limit(max_in_flight)
        end
      end
      redis.call("HSET", state, "check_ms", 0)
      check_ms = 0
    end
  end

  if outcome == "ok" then
    local capacity, balance = bounds()
    if drain > 0 and balance < UNBOUNDED then
      -- The answer was billed: what is left of the balance covers drain fewer worst cases. The
      -- capacity window loses nothing: the provider served it.
      balance = math.max(min_limit, balance - drain)
      redis.call("HSET", state, "balance_limit", tostring(balance))
      limit = current_limit(max_in_flight)
    end
    -- Grow only while the limit is what holds the fleet back: a fleet with fewer greenlets than
    -- its limit would otherwise raise it without bound, and the next cut would find it meaningless.
    -- "At the limit" with a margin: slots freed in one process are refilled by another only after
    -- its next poll, so a busy fleet sits a few requests under its limit most of the time.
    -- Not while a cut is being checked: the check must see the cut limit, not one grown past it.
    -- Only the limit that holds it grows (the capacity window where both do): the other has no
    -- new evidence. The balance bound grows too, as after a 402 the balance's estimate was a cut's.
    local cap = max_in_flight > 0 and max_in_flight or UNBOUNDED
    if limit < UNBOUNDED and limit < cap and check_ms == 0
        and in_flight >= math.min(math.floor(limit) - 1, grow_near * limit) then
      if capacity <= balance then
        redis.call("HSET", state, "limit", tostring(math.min(cap, capacity + 1 / capacity)))
      else
        redis.call("HSET", state, "balance_limit", tostring(balance + 1 / balance))
      end
      limit = current_limit(max_in_flight)
    end
    return limit
  end

  -- throttled. What the provider serves is what was in flight when the event began minus what it
  -- refused: each refusal of the event lowers the estimate by one. A fleet starting unbounded with
  -- 1,500 requests against a capacity of 300 thus lands near beta x 300 in one event, not after
  -- fifteen 10% cuts; at steady state (one request over the capacity) it is the plain beta x cut.
  local cut, event_limit, event_in_flight, refused = event_of(CAPACITY)
  local share = math.min(1, refused_recently / math.max(started, 1))
  if now - cut >= cut_gap then  -- not within an event: does this 429 begin one?
    -- Above the background by more than chance makes of it: z binomial standard deviations of a
    -- share of this many requests (and at least the margin).
    local noise = noise_z * math.sqrt(bg * (1 - bg) / math.max(started, 1))
    if check_ms > 0 or started < min_requests or share <= bg + math.max(margin, noise) then
      return limit  -- a background 429 (or the last cut is still being checked)
    end
    cut, event_limit, event_in_flight, refused = now, limit, in_flight, 0
    redis.call("HSET", state, "check_ms", now + math.max(cut_gap, retry_after), "check_limit", tostring(bounds()),
               "check_started", 0, "check_thr", 0)
  end
  -- The share the check compares with: as the event's refusals come in (judged at its first 429s,
  -- a burst's share is still a few per cent).
  redis.call("HSET", state, "check_share", tostring(share))
  return cut_in_event(CAPACITY, max_in_flight, cut, event_limit, event_in_flight, refused, beta, min_limit, now,
                      retry_after)
end

-- How long a share's unanswered want keeps borrowers off: a few of its polls (workers/fleet/gate.py POLL_S).
local WANT_MS = 250

if op == "acquire" then
  local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
  local max_in_flight, max_per_s, window = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
  local keep_free = tonumber(ARGV[7])
  local wanted = #ARGV - 7  -- slot ids: ARGV[8], ARGV[9] ...
  redis.call("ZREMRANGEBYSCORE", slots, "-inf", now)
  if redis.call("HEXISTS", state, "hold") == 1 then return {"wait", 0, "hold"} end
  local pause = tonumber(redis.call("HGET", state, "pause_ms") or "0")
  if pause > now then return {"wait", pause - now, "pause"} end
  local limit = current_limit(max_in_flight)
  if keep_free > 0 and tonumber(redis.call("HGET", state, "want_ms") or "0") > now then
    return {"wait", 0, "limit"}
  end
  local grant = math.min(wanted, math.max(1, math.floor(limit)) - redis.call("ZCARD", slots) - keep_free)
  if grant < 1 then
    if keep_free == 0 then redis.call("HSET", state, "want_ms", now + WANT_MS) end
    return {"wait", 0, "limit"}
  end
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
  for i = 1, grant do redis.call("ZADD", slots, now + ttl, ARGV[7 + i]) end
  count_window(now, window, grant, 0, 0)
  local check_ms = tonumber(redis.call("HGET", state, "check_ms") or "0")
  if check_ms > 0 and now >= check_ms then redis.call("HINCRBY", state, "check_started", grant) end
  return {"ok", grant, tostring(limit)}

elseif op == "release" then
  local now, limit = tonumber(ARGV[2]), 0
  for i = 16, #ARGV, 6 do
    limit = release_one(ARGV[i], now, ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]),
                        tonumber(ARGV[i + 5]))
  end
  if ARGV[15] == "1" then redis.call("HSET", state, "want_ms", now + WANT_MS) end
  return {"released", tostring(limit)}

elseif op == "state" then
  local now = tonumber(ARGV[2])
  redis.call("ZREMRANGEBYSCORE", slots, "-inf", now)
  local s = redis.call("HMGET", state, "limit", "pause_ms", "ok", "throttled", "cap", "bg", "bg_ms", "budget",
                       "balance_limit")
  local bg = tonumber(s[6] or "0") * 0.5 ^ ((now - tonumber(s[7] or now)) / tonumber(ARGV[3]))
  local lower = math.min(tonumber(s[1] or UNBOUNDED), tonumber(s[9] or UNBOUNDED))
  return {lower < UNBOUNDED and tostring(lower) or "", redis.call("ZCARD", slots),
          math.max(0, tonumber(s[2] or "0") - now), tonumber(s[3] or "0"), tonumber(s[4] or "0"), s[5] or "",
          tostring(bg), tonumber(s[8] or "0"), s[1] or "", s[9] or ""}

elseif op == "reset" then
  local cap = tonumber(ARGV[2])
  redis.call("DEL", state)
  if cap > 0 then redis.call("HSET", state, "cap", cap) end
  if ARGV[3] == "1" then redis.call("HSET", state, "hold", "1") end
  local start = tonumber(ARGV[4] or "0")
  if start > 0 then redis.call("HSET", state, "balance_limit", tostring(start)) end
  return "reset"

elseif op == "unhold" then
  redis.call("HDEL", state, "hold")
  return "unheld"
end

return redis.error_reply("throttle.lua: unknown operation " .. tostring(op))
