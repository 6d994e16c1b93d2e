-- The budget of one dataset (and the run's dollars): admission, exactly-once counting and the row
-- hand-off, atomically. common/budget.py is its only caller and the only Python that names a field.
--
-- KEYS[1] budget   HASH   the dataset's counters:
--                           tokens_rule     hard | projected (how tokens are admitted)
--                           tokens_limit    token budget; tokens_kept, tokens_kept_sq (sum of squares)
--                                           and rows_kept of kept rows
--                           tokens_held     sum of the token holds of live leases (hard: worst cases)
--                           round_leases, round_held: how many of them are a batch round's
--                                           requests, and the sum of their (mean) holds
--                           round_margin    the round's margin, held beside them (part of tokens_held)
--                           round_z, round_worst: the z and W it was last reckoned with
--                           tokens_max_seen the largest answer kept or discarded so far: the hard rule's
--                                           worst case when it exceeds max_tokens (our tokenizer may
--                                           count more than the provider that enforced max_tokens)
--                           nusd_limit      dollar budget in nano-dollars (0: none); nusd_spent: every
--                                           billed answer's usage.cost, kept or not
--                           nusd_held       worst-case cost of live leases plus orphans; nusd_orphaned
--                                           the orphans' part
--                           admission_state active | exhausted | stopped
--                           ended_by        tokens | usd | run_usd: the limit that exhausted it
-- KEYS[2] done     SET    prompt ids whose row was kept: the exactly-once guard
-- KEYS[3] leases   HASH   prompt id -> "<lease>|<hold tokens>|<hold nano-usd>|<expires_ms>", and "|r"
--                         after it for a batch round's statistical hold
-- KEYS[4] failed   HASH   prompt id -> JSON {reason, attempts, detail}
-- KEYS[5] results  STREAM kept rows, fields: id <prompt id>, row <msgpack row>
-- KEYS[6] halt     STRING set when OpenRouter refused the account: nothing is admitted anywhere
-- KEYS[7] run      HASH   the run's dollars across datasets: nusd_limit, nusd_spent, nusd_held,
--                         nusd_orphaned, admission_state (active | exhausted), ended_by
-- KEYS[8] orphans  HASH   lease -> nano-usd held for a reaped lease whose answer may still be billed
-- KEYS[9] turns    HASH   row key "<id>#<turn>" -> msgpack {message, end}: regenerate = "all" only
-- KEYS[10] ended   SET    conversation ids that ended with a kept turn: regenerate = "all" only
-- KEYS[11] stats   HASH   the dataset's usage counters: common/accounting.py's COUNTERS, by their source
--                         field (a test checks that this script writes no other). Added here: a billed
--                         answer's, from the usage ARGV of settle, fail and release (the counters whose
--                         `usage` is set, common/stats.answer_counts), and any a line add(stats, "<field>", n)
--                         below adds; the others by workers (common/stats.py's DatasetStats.add).
-- KEYS[12] settled HASH   "<lease>:<id>" -> "<answer>|<over_hold>": that lease's settle, fail or release of the
--                         prompt was applied
--
-- The rule. A request asks with its worst case: W tokens (max_tokens plus the turn's own tokens, or
-- the largest answer seen if that is more) and
-- C nano-dollars (prompt tokens x prompt price + max_tokens x completion price + request price).
--   Dollars, always: admitted only if spent + held + C <= limit, for the dataset and for the run.
--     Settling frees the hold and adds the real cost (<= C), so spent + held <= limit holds after
--     every step: spent never crosses the limit while answers cost no more than their worst case.
--   Tokens, rule "hard" (the default): admitted only if kept + tokens_held + W <= limit, the same
--     invariant. A settle keeps its row only if kept + tokens_held (less a batch round's margin,
--     below) + tokens still fits (always true
--     for an answer of a live lease within its hold); otherwise the row is discarded but billed
--     (failed "over_budget"): kept never crosses the limit, whatever lands.
--   Tokens, rule "hard", a batch round (reserve's z > 0): a round's answers land together, a batch
--     latency (minutes to hours) after it was admitted, so holding each at its worst case makes a
--     dataset take a round per ~2/3 of what is left. Once round_rows rows are kept, a batch request
--     holds the kept mean m instead (at most W), and the round's n requests in flight hold, beside
--     those, one margin z * s * sqrt(n + n^2/rows) (s the kept rows' deviation, at least 10% of W;
--     n^2/rows the error of m itself; at most n worst cases in all). A landing answer may use the
--     margin (the settle's check leaves it out); then the margin is reckoned again for the requests
--     still out, within the room left. So a round overruns only when its answers' sum passes its
--     means by more than the margin: odds of about a normal tail beyond z.
--     The same invariant admits it (kept + tokens_held + hold <= limit) and a settle without room
--     is discarded as always, so kept still never crosses the limit; what an overrun costs is its
--     discarded answers' dollars, which the dollar rule (always worst cases) still bounds.
--   Tokens, rule "projected" (the earlier rule): the estimate E starts at a prior (weighing as
--     prior_weight rows, or as the excess of in-flight over kept rows) and moves to the measured mean;
--     in-flight requests are projected with the length-biased mean sum(x^2)/sum(x) (the long answers
--     are the ones still in flight). Admitted if kept + in_flight x that + E <= limit. Admitted
--     requests always land, so it can end slightly over.
--   Full: "over" (the dataset, or the run, turns exhausted) when no landing could make room:
--     kept + W > limit (hard), spent + orphaned + C > limit, or, projected, kept + E > limit or the
--     estimate rests on at least trust_rows rows and no fewer than are in flight; otherwise "wait"
--     and ask again once in-flight requests have landed. So a hard budget ends less than one worst
--     case short of its limit.
--   Dead workers: reap (or a take-over by another delivery) frees an expired lease's token hold but
--     keeps its dollars held as an orphan: a non-streamed request is billed in full once generated,
--     so the money may be spent. If its answer lands after all, settle/fail/release by that lease
--     resolve the orphan: the real cost replaces the hold; the row is kept only if it fits.
--   Once per lease: settle, fail and release record their answer under (lease, id) in `settled`, in
--     the same execution that counts. A worker whose reply was lost cannot know whether its call
--     landed (Redis frozen: the commands waited in the server's buffer after the read timed out,
--     then ran), so it repeats it: the spool replays it, redis-py resends the pipeline. The repeat
--     finds the marker, answers what the first execution answered and adds nothing: no dollar, no
--     request, no token, no row. Another delivery of the prompt has another lease: its answer was
--     billed again and is counted again (billed is billed). A release records a marker only when it
--     counts something (a repeat of an empty one adds nothing anyway). The markers expire
--     SETTLED_KEEP_S (7 days) after the dataset's last outcome: a running worker replays its spool
--     within seconds of Redis' return; only an entry left by a worker first started again after
--     that would count twice.
--
-- ARGV[1] is the operation; the rest depends on it:
--   reserve id lease now_ms ttl_ms worst_tokens worst_nusd prior prior_weight trust_rows [z round_rows]
--           z: a batch round's statistical hold once round_rows rows are kept (see the rule; 0 or
--           absent: the worst case)
--           -> {"ok", hold} | {"done"} (kept, or failed in this run) | {"stopped"} | {"busy", ms_left} | {"over", hold}
--              | {"wait", hold} | {"halted"}
--   round_hold worst_tokens z round_rows -> {tokens}: what a batch round's next request would take
--           now, its hold and what the round's margin grows by (read only; projected: the worst case)
--   renew   id lease now_ms ttl_ms -> {"ok"} | {"done"} | {"stopped"} | {"halted"} | {"lost"}
--           Extends a live lease before a retry (works while exhausted; "stopped" ends it). "lost":
--           the lease was reaped; no budget is taken: the caller releases and asks again later.
--   settle  id lease tokens cost_nusd attempts row usage [turn conversation ends]
--           -> {"kept", kept, limit, over_hold} | {"duplicate", over_hold} | {"discarded", over_hold}
--              over_hold is 1 when the answer cost more than the worst case it held (a wrong price)
--              With a turn (regenerate = "all"; id is the row key), a kept row also stores the turn
--              under id in turns and, when ends is "1", adds the conversation to ended: a redelivered
--              conversation reads back exactly the turns that were counted.
--              usage: the billed answer's stats increments, a JSON object {field: n}, or "" (none).
--              A repeat of an applied settle (same lease) answers its first answer (kept: with the
--              kept tokens of now), counting nothing.
--   fail    id lease failure_json cost_nusd usage -> {"failed"} | {"duplicate"}   (once per lease, as settle)
--   release id lease cost_nusd usage -> {"released"}   (give back an admission, no outcome; once per lease)
--   reap    now_ms                 -> {"reaped", n}
--   open    tokens_limit nusd_limit rule -> {"open", kept, rows}   (start or resume the dataset)
--   close                          -> {"closed"}
--   reconcile last_id n_rows tokens tokens_sq cost_nusd check|apply manifests id...
--           -> {"current", rows} | {"mismatch", rows} | {"reconciled", rows, lost, dropped}: done and
--           the kept counters become the rows on disk (ids, up to stream position last_id) plus those
--           waiting in results after it (see the op), less the waiting rows whose manifest is not one
--           of manifests (comma-separated; "": any), which are deleted and their prompts asked again.
--   drop_rows (stream_id id tokens)... -> {"dropped", n}: rows waiting in results deleted and uncounted
--           (their prompts asked again): another run's, that the collector does not write
--   run_open nusd_limit            -> {"run_open", spent}   KEYS[1] is the run hash, KEYS[2..] the
--           budget hashes of the run's datasets: the run's dollars are re-summed from them.
local op = ARGV[1]

local function num(v) return tonumber(v or "0") or 0 end
-- Integers as Redis arguments: a Lua number would be sent as "%.14g", which turns 1e14 into "1e+14".
local function int(n) return string.format("%.0f", n) end
local function add(h, f, n) if n ~= 0 then redis.call("HINCRBY", h, f, int(n)) end end
-- How long a lease's settled marker outlives the dataset's last outcome, in seconds (7 days).
local SETTLED_KEEP_S = 604800

if op == "run_open" then
  local spent, held, orphaned = 0, 0, 0
  for i = 2, #KEYS do
    local b = redis.call("HMGET", KEYS[i], "nusd_spent", "nusd_held", "nusd_orphaned")
    spent, held, orphaned = spent + num(b[1]), held + num(b[2]), orphaned + num(b[3])
  end
  redis.call("HSET", KEYS[1], "nusd_limit", ARGV[2], "nusd_spent", int(spent), "nusd_held", int(held),
             "nusd_orphaned", int(orphaned), "admission_state", "active")
  redis.call("HDEL", KEYS[1], "ended_by")
  return {"run_open", spent}
end

local budget, done, leases, failed, results, halt, run, orphans =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local stats, settled = KEYS[11], KEYS[12]

-- The answer an earlier execution of this lease's outcome of the prompt gave (word, over_hold), or nil.
local function applied(id, lease)
  local mark = redis.call("HGET", settled, lease .. ":" .. id)
  if not mark then return nil end
  local word, over_hold = string.match(mark, "^(.*)|(%d)$")
  return word, tonumber(over_hold)
end

-- Records that this lease's outcome was applied (see "Once per lease" in the header).
local function mark_applied(id, lease, word, over_hold)
  redis.call("HSET", settled, lease .. ":" .. id, word .. "|" .. over_hold)
  redis.call("EXPIRE", settled, SETTLED_KEEP_S)
end

local function count_usage(raw)
  if raw == nil or raw == "" then return end
  for field, n in pairs(cjson.decode(raw)) do add(stats, field, n) end
end

-- lease, hold tokens, hold nano-usd, expiry, and its suffix ("|r": a batch round's hold, else "").
local function parse_lease(raw)
  local round = ""
  if string.sub(raw, -2) == "|r" then raw, round = string.sub(raw, 1, -3), "|r" end
  local lease, tok, usd, exp = string.match(raw, "^(.*)|(%d+)|(%d+)|(%d+)$")
  return lease, tonumber(tok), tonumber(usd), tonumber(exp), round
end

-- A lease's token hold taken (sign 1) or given back (-1), a batch round's counted apart too.
local function hold_tokens(tok, round, sign)
  add(budget, "tokens_held", sign * tok)
  if round ~= "" then
    add(budget, "round_leases", sign)
    add(budget, "round_held", sign * tok)
  end
end

local function hold_usd(n)
  add(budget, "nusd_held", n)
  add(run, "nusd_held", n)
end

local function spend(nusd)
  add(budget, "nusd_spent", nusd)
  add(run, "nusd_spent", nusd)
end

-- SADD of list[first..], in parts: unpack() can return only so many values at once.
local function add_members(key, list, first)
  for i = first, #list, 5000 do
    redis.call("SADD", key, unpack(list, i, math.min(i + 4999, #list)))
  end
end

-- The kept counters become the rows on disk; their costs are a floor of what was spent (billed
-- answers not kept are lost).
local function set_kept(n, tokens, tokens_sq, cost)
  redis.call("HSET", budget, "tokens_kept", int(tokens), "rows_kept", int(n), "tokens_kept_sq", int(tokens_sq))
  local spent = num(redis.call("HGET", budget, "nusd_spent"))
  if cost > spent then spend(cost - spent) end
end

-- The margin of a batch round's n requests holding base_sum (see the rule), at most what n worst
-- cases leave beside their holds.
local function margin_for(n, base_sum, z, worst_tok)
  local b = redis.call("HMGET", budget, "tokens_kept", "tokens_kept_sq", "rows_kept")
  local kept, kept_sq, rows = num(b[1]), num(b[2]), num(b[3])
  if n <= 0 or z <= 0 or rows <= 0 or kept <= 0 then return 0 end
  local mean = kept / rows
  local var = math.max(kept_sq / rows - mean * mean, (0.1 * worst_tok) ^ 2)
  return math.max(0, math.min(math.ceil(z * math.sqrt(var * (n + n * n / rows))), n * worst_tok - base_sum))
end

-- round_margin reckoned again for the round's requests in flight now; never beyond the room the
-- rest of what is held leaves (answers already out cannot be held back: kept + held <= limit).
local function remargin()
  local b = redis.call("HMGET", budget, "round_leases", "round_held", "round_margin", "round_z", "round_worst",
                       "tokens_limit", "tokens_kept", "tokens_held")
  local old = num(b[3])
  local new = margin_for(num(b[1]), num(b[2]), num(b[4]), num(b[5]))
  new = math.max(0, math.min(new, num(b[6]) - num(b[7]) - (num(b[8]) - old)))
  if new ~= old then
    add(budget, "tokens_held", new - old)
    redis.call("HSET", budget, "round_margin", int(new))
  end
end

-- An expired lease: its tokens go back, its dollars stay held as an orphan (see the header).
local function orphan_lease(id, raw)
  local holder, tok, usd, _, round = parse_lease(raw)
  redis.call("HDEL", leases, id)
  hold_tokens(tok, round, -1)
  if round ~= "" then remargin() end
  if usd > 0 then
    redis.call("HSET", orphans, holder, int(usd))
    add(budget, "nusd_orphaned", usd)
    add(run, "nusd_orphaned", usd)
  end
end

-- Ends the request (id, lease): frees its hold, live or orphaned. Returns the dollars it held.
local function finish(id, lease)
  local raw = redis.call("HGET", leases, id)
  if raw then
    local holder, tok, usd, _, round = parse_lease(raw)
    if holder == lease then
      redis.call("HDEL", leases, id)
      hold_tokens(tok, round, -1)
      if round ~= "" then remargin() end
      hold_usd(-usd)
      return usd
    end
  end
  local o = redis.call("HGET", orphans, lease)
  if o then
    local usd = tonumber(o)
    redis.call("HDEL", orphans, lease)
    hold_usd(-usd)
    add(budget, "nusd_orphaned", -usd)
    add(run, "nusd_orphaned", -usd)
    return usd
  end
  return 0
end

-- A settle's, fail's or release's bill: the request ends (its hold freed) and its answer's cost and
-- usage count, whatever happens to the row (money spent is spent). Returns the dollars it held.
local function bill(id, lease, cost, usage)
  local held_usd = finish(id, lease)
  spend(cost)
  count_usage(usage)
  return held_usd
end

local function exhaust(by, run_too)
  redis.call("HSET", budget, "admission_state", "exhausted", "ended_by", by)
  if run_too then redis.call("HSET", run, "admission_state", "exhausted", "ended_by", by) end
end

-- "over", "wait" or nil for a dollar limit (0: none).
local function dollar_verdict(limit, spent, held, orphaned, worst)
  if limit <= 0 then return nil end
  if spent + orphaned + worst > limit then return "over" end
  if spent + held + worst > limit then return "wait" end
  return nil
end

-- The next request of a batch round (z > 0): its hold, "|r", and what the round's margin grows by
-- with it; else (z = 0, or too few rows kept to know the answers) the worst case, "", 0.
local function round_hold(worst_tok, z, round_rows)
  local b = redis.call("HMGET", budget, "tokens_kept", "rows_kept", "round_leases", "round_held", "round_margin")
  local kept, rows, n, base_sum = num(b[1]), num(b[2]), num(b[3]), num(b[4])
  if z <= 0 or rows < round_rows or rows <= 0 or kept <= 0 then return worst_tok, "", 0 end
  local hold = math.min(worst_tok, math.ceil(kept / rows))
  return hold, "|r", margin_for(n + 1, base_sum + hold, z, worst_tok) - num(b[5])
end

if op == "reserve" then
  local id, lease = ARGV[2], ARGV[3]
  local now, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
  local worst_tok, worst_usd = tonumber(ARGV[6]), tonumber(ARGV[7])
  local prior, prior_weight, trust_rows = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
  if redis.call("SISMEMBER", done, id) == 1 then return {"done"} end
  -- A failure is final for this run (the next run clears `failed` and asks again): a stray second
  -- delivery (a restored message after a Redis restart) must not pay for the prompt again.
  if redis.call("HEXISTS", failed, id) == 1 then return {"done"} end
  if redis.call("EXISTS", halt) == 1 then
    finish(id, lease)
    return {"halted"}
  end
  local state = redis.call("HGET", budget, "admission_state")
  if state ~= "active" and state ~= "exhausted" then return {"stopped"} end
  local raw = redis.call("HGET", leases, id)
  if raw then
    local holder, tok, _, exp = parse_lease(raw)
    if holder == lease then return {"ok", tok} end
    if exp > now then return {"busy", exp - now} end
    orphan_lease(id, raw)  -- its holder died or stalled: take its place
  end
  if state ~= "active" then return {"stopped"} end
  if redis.call("HGET", run, "admission_state") == "exhausted" then
    exhaust("run_usd", false)
    return {"over", 0}
  end

  local b = redis.call("HMGET", budget, "tokens_rule", "tokens_limit", "tokens_kept", "tokens_kept_sq",
                       "tokens_held", "rows_kept", "nusd_limit", "nusd_spent", "nusd_held", "nusd_orphaned",
                       "tokens_max_seen")
  local rule, limit, kept, kept_sq = b[1], num(b[2]), num(b[3]), num(b[4])
  local held, rows = num(b[5]), num(b[6])
  local r = redis.call("HMGET", run, "nusd_limit", "nusd_spent", "nusd_held", "nusd_orphaned")

  local hold, tokens
  local round, grows, z, round_rows = "", 0, tonumber(ARGV[11] or "0") or 0, tonumber(ARGV[12] or "0") or 0
  if rule == "hard" then
    worst_tok = math.max(worst_tok, num(b[11]))
    hold, round, grows = round_hold(worst_tok, z, round_rows)
    if kept + worst_tok > limit then tokens = "over"
    elseif kept + held + hold + grows > limit then tokens = "wait" end
  else
    local in_flight = redis.call("HLEN", leases)
    local weight = math.max(prior_weight, in_flight - rows)
    hold = math.ceil((prior * weight + kept) / (weight + rows))
    local in_flight_each = math.ceil((prior * prior * weight + kept_sq) / (prior * weight + kept))
    if kept + in_flight * in_flight_each + hold > limit then
      if kept + hold > limit or (rows >= trust_rows and rows >= in_flight) then tokens = "over"
      else tokens = "wait" end
    end
  end
  local usd = dollar_verdict(num(b[7]), num(b[8]), num(b[9]), num(b[10]), worst_usd)
  local run_usd = dollar_verdict(num(r[1]), num(r[2]), num(r[3]), num(r[4]), worst_usd)

  if tokens == "over" then exhaust("tokens", false); return {"over", hold} end
  if usd == "over" then exhaust("usd", false); return {"over", hold} end
  if run_usd == "over" then exhaust("run_usd", true); return {"over", hold} end
  if tokens or usd or run_usd then return {"wait", hold} end

  redis.call("HSET", leases, id, lease .. "|" .. int(hold) .. "|" .. int(worst_usd) .. "|" .. int(now + ttl) .. round)
  hold_tokens(hold, round, 1)
  if round ~= "" then
    redis.call("HSET", budget, "round_z", tostring(z), "round_worst", int(worst_tok))
    remargin()
  end
  hold_usd(worst_usd)
  return {"ok", hold}

elseif op == "round_hold" then
  -- What a batch round's next request would hold now (the producer queues what the room admits).
  local worst_tok, z, round_rows = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
  local b = redis.call("HMGET", budget, "tokens_rule", "tokens_max_seen")
  worst_tok = math.max(worst_tok, num(b[2]))
  if b[1] ~= "hard" then return {worst_tok} end
  local hold, _, grows = round_hold(worst_tok, z, round_rows)
  return {hold + grows}

elseif op == "renew" then
  local id, lease, now, ttl = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  if redis.call("SISMEMBER", done, id) == 1 then return {"done"} end
  if redis.call("EXISTS", halt) == 1 then
    finish(id, lease)
    return {"halted"}
  end
  local state = redis.call("HGET", budget, "admission_state")
  if state ~= "active" and state ~= "exhausted" then return {"stopped"} end
  local raw = redis.call("HGET", leases, id)
  if raw then
    local holder, tok, usd, _, round = parse_lease(raw)
    if holder == lease then
      -- The holder renews before each retry: a lease only has to outlive one attempt.
      redis.call("HSET", leases, id, lease .. "|" .. int(tok) .. "|" .. int(usd) .. "|" .. int(now + ttl) .. round)
      return {"ok"}
    end
  end
  return {"lost"}

elseif op == "settle" then
  local id, lease, tokens, cost = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
  local attempts, row, usage = tonumber(ARGV[6]), ARGV[7], ARGV[8]
  local turn, conversation, ends = ARGV[9], ARGV[10], ARGV[11]
  local first, first_over = applied(id, lease)
  if first == "kept" then
    local b = redis.call("HMGET", budget, "tokens_kept", "tokens_limit")
    return {"kept", num(b[1]), num(b[2]), first_over}
  elseif first then
    return {first, first_over}
  end
  local held_usd = bill(id, lease, cost, usage)
  local over_hold = (held_usd > 0 and cost > held_usd) and 1 or 0
  if redis.call("SISMEMBER", done, id) == 1 then
    mark_applied(id, lease, "duplicate", over_hold)
    return {"duplicate", over_hold}
  end
  local b = redis.call("HMGET", budget, "tokens_rule", "tokens_limit", "tokens_kept", "tokens_held",
                       "tokens_max_seen", "round_margin")
  if tokens > num(b[5]) then redis.call("HSET", budget, "tokens_max_seen", tokens) end
  -- A batch round's margin is held for answers like this one: it may take it (the margin of the
  -- round's requests still out is reckoned again, within the room left, once it is kept).
  if b[1] == "hard" and num(b[3]) + num(b[4]) - num(b[6]) + tokens > num(b[2]) then
    redis.call("HSET", failed, id, cjson.encode({reason = "over_budget", attempts = attempts,
      detail = "answer of " .. tokens .. " tokens landed without room under the hard token cap: billed, not kept"}))
    mark_applied(id, lease, "discarded", over_hold)
    return {"discarded", over_hold}
  end
  mark_applied(id, lease, "kept", over_hold)
  redis.call("SADD", done, id)
  local kept = redis.call("HINCRBY", budget, "tokens_kept", tokens)
  redis.call("HINCRBY", budget, "rows_kept", 1)
  redis.call("HINCRBY", budget, "tokens_kept_sq", int(tokens * tokens))
  if num(b[6]) > 0 then remargin() end
  redis.call("HDEL", failed, id)
  redis.call("XADD", results, "*", "id", id, "row", row)
  if turn then
    redis.call("HSET", KEYS[9], id, turn)
    if ends == "1" then redis.call("SADD", KEYS[10], conversation) end
  end
  return {"kept", kept, num(b[2]), over_hold}

elseif op == "fail" then
  local id, lease, failure, cost = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
  local first = applied(id, lease)
  if first then return {first} end
  bill(id, lease, cost, ARGV[6])
  local word = "failed"
  if redis.call("SISMEMBER", done, id) == 1 then word = "duplicate"
  else redis.call("HSET", failed, id, failure) end
  mark_applied(id, lease, word, 0)
  return {word}

elseif op == "release" then
  local id, lease, cost, usage = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
  if applied(id, lease) then return {"released"} end
  bill(id, lease, cost, usage)
  if cost ~= 0 or (usage ~= nil and usage ~= "") then mark_applied(id, lease, "released", 0) end
  return {"released"}

elseif op == "reap" then
  local now, n = tonumber(ARGV[2]), 0
  local all = redis.call("HGETALL", leases)
  for i = 1, #all, 2 do
    local _, _, _, exp = parse_lease(all[i + 1])
    if exp <= now then
      orphan_lease(all[i], all[i + 1])
      n = n + 1
    end
  end
  return {"reaped", n}

elseif op == "open" then
  -- Holds are re-derived from the leases and orphans, so a crash between two writes can't leak
  -- budget; the run's dollars move by the same difference.
  local tok, usd, orphaned, round_n, round_tok = 0, 0, 0, 0, 0
  local all = redis.call("HGETALL", leases)
  for i = 2, #all, 2 do
    local _, t, u, _, round = parse_lease(all[i])
    tok, usd = tok + t, usd + u
    if round ~= "" then round_n, round_tok = round_n + 1, round_tok + t end
  end
  local o = redis.call("HVALS", orphans)
  for i = 1, #o do orphaned = orphaned + tonumber(o[i]) end
  local before = redis.call("HMGET", budget, "nusd_held", "nusd_orphaned")
  add(run, "nusd_held", usd + orphaned - num(before[1]))
  add(run, "nusd_orphaned", orphaned - num(before[2]))
  redis.call("HSET", budget, "tokens_limit", ARGV[2], "nusd_limit", ARGV[3], "tokens_rule", ARGV[4],
             "admission_state", "active", "tokens_held", int(tok), "nusd_held", int(usd + orphaned),
             "nusd_orphaned", int(orphaned), "round_leases", round_n, "round_held", int(round_tok), "round_margin", 0)
  redis.call("HDEL", budget, "ended_by")
  for _, f in ipairs({"tokens_kept", "rows_kept", "tokens_kept_sq", "nusd_spent"}) do
    redis.call("HSETNX", budget, f, 0)
  end
  remargin()  -- the round's requests still out, if any, hold their margin again
  local b = redis.call("HMGET", budget, "tokens_kept", "rows_kept")
  return {"open", num(b[1]), num(b[2])}

elseif op == "close" then
  redis.call("HSET", budget, "admission_state", "stopped")
  return {"closed"}

elseif op == "drop_rows" then
  -- Rows waiting in the results stream that the collector will not write (another run's, made under
  -- a manifest its folder does not hold): deleted and no longer kept, so their prompts are asked again.
  local n = 0
  for i = 2, #ARGV, 3 do
    local entry, id, t = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
    if redis.call("XDEL", results, entry) == 1 and redis.call("SREM", done, id) == 1 then
      add(budget, "tokens_kept", -t)
      add(budget, "rows_kept", -1)
      add(budget, "tokens_kept_sq", -int(t * t))
      n = n + 1
    end
  end
  return {"dropped", n}

elseif op == "reconcile" then
  -- The rows on disk up to the stream position last_id, and those waiting in the results stream
  -- after it, are what is kept: done and the kept counters become exactly these. An id done but in
  -- neither (its row lost from the shards: written over by a producer that had lost its lock) is
  -- asked again instead of counted for ever. "check" only answers whether they already agree.
  local last_id, n, tokens, tokens_sq, cost = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
    tonumber(ARGV[6])
  local truth, keys_n = {}, n
  for i = 9, #ARGV do truth[ARGV[i]] = true end
  -- A row waiting in the stream that another run made under a manifest this folder does not hold
  -- (the same dataset name, another config and output folder) is no row of this folder's.
  local accepted, any = {}, ARGV[8] == ""
  for m in string.gmatch(ARGV[8], "[^,]+") do accepted[m] = true end
  local function foreign(row)
    local m = cmsgpack.unpack(row).manifest
    return not any and m ~= nil and not accepted[m]
  end
  local waiting = redis.call("XRANGE", results, "(" .. last_id, "+")
  local function fields(e)
    local f, id, row = e[2], nil, nil
    for j = 1, #f, 2 do
      if f[j] == "id" then id = f[j + 1] elseif f[j] == "row" then row = f[j + 1] end
    end
    return id, row
  end
  local rows, members = num(redis.call("HGET", budget, "rows_kept")), redis.call("SCARD", done)
  if ARGV[7] == "check" then
    for _, e in ipairs(waiting) do
      local _, row = fields(e)
      if row and foreign(row) then return {"mismatch", rows} end
    end
    if rows == members and rows == n + #waiting then return {"current", rows} end
    return {"mismatch", rows}
  end
  local dropped = 0
  for _, e in ipairs(waiting) do
    local id, row = fields(e)
    if row and foreign(row) then
      redis.call("XDEL", results, e[1])
      dropped = dropped + 1
    elseif id and not truth[id] then
      truth[id] = true
      local t = tonumber(cmsgpack.unpack(row).num_tokens) or 0
      keys_n, tokens, tokens_sq = keys_n + 1, tokens + t, tokens_sq + t * t
    end
  end
  local lost = {}
  for _, id in ipairs(redis.call("SMEMBERS", done)) do
    if not truth[id] then lost[#lost + 1] = id end
  end
  if #lost == 0 and rows >= keys_n then return {"current", rows, 0, 0} end
  for i = 1, #lost, 5000 do
    local part = {unpack(lost, i, math.min(i + 4999, #lost))}
    redis.call("SREM", done, unpack(part))
    redis.call("HDEL", KEYS[9], unpack(part))  -- regenerate = "all": the lost turn is asked again
    for _, key in ipairs(part) do
      local conversation = string.match(key, "^(.*)#%d+$")
      if conversation then redis.call("SREM", KEYS[10], conversation) end
    end
  end
  local add_ids = {}
  for id in pairs(truth) do add_ids[#add_ids + 1] = id end
  add_members(done, add_ids, 1)
  set_kept(keys_n, tokens, tokens_sq, cost)
  return {"reconciled", keys_n, #lost, dropped}
end

return redis.error_reply("budget.lua: unknown operation " .. tostring(op))
