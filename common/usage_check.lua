-- Billed usage against the fleet's own counts: one answer's verdict and the run's halt rule, atomically.
-- common/usage_check.py is its only caller.
--
-- KEYS[1] check  HASH  the run config's usage check (keys.usage_check(cid)):
--                        n        answers checked so far, counted up to `window`
--                        pm|<provider>:<d>  how many of them the provider billed d prompt tokens more than the
--                                           fleet counts
--                        cm|<provider>:<d>  how many of them that ended (stop, tool_calls) it billed d completion
--                                           tokens more
--                        pm|<provider>, pm|<provider>_n  its most common prompt difference so far (the learned
--                                           offset; the first to reach a count wins ties) and its count; cm|… the
--                                           completion's. Per provider: one serving the model may count the end
--                                           token and another not, and a run's answers come from several
--                        miss     answers within the window that disagreed with the offset of their moment
--
-- ARGV: p c ended window allowed declared ttl_s provider
--   p, c      the answer's billed prompt/completion tokens minus the fleet's counts of its prompt ids and
--             rebuilt completion ids (with the end-of-turn token the fleet appends to an ended answer)
--   ended     1: the answer ended (the fleet appended its end-of-turn token); 0: cut (finish_reason length)
--   window    the first answers the halt rule watches and the offset is learned from (then it is frozen)
--   allowed   mismatches among them that do not halt the run
--   declared  "<p>:<c>" ([model] usage_offset) or "" (learned)
--   ttl_s     the hash's expiry, renewed by every call
--   provider  who answered (the learned offsets are its own; "" when unnamed)
--
-- The prompt offset is learned from every answer, the completion's from the ended ones only: a cut
-- answer has no end-of-turn token, which the offset may hold (a server that does not count it
-- learns c = -1), so its completion agrees at c = C or C + 1. A difference with nothing learned yet
-- agrees (the first answer sets the offset).
--
-- -> {match (0|1), expected p, expected c, mismatches within the window, halt (0|1)}
--    halt: the window's mismatches are over `allowed`. They never go down, so a run past it halts at
--    once and stays halted on a resume of the same config.
local key = KEYS[1]
local p, c, ended = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3] == "1"
local window, allowed, declared, ttl_s = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], ARGV[7]
local provider = ARGV[8]

local n = tonumber(redis.call("HGET", key, "n") or "0")
local in_window = n < window
if in_window then
  redis.call("HINCRBY", key, "n", 1)
end

-- The mode of one difference after counting `d` (when `learn`): the offset it is held to, or nil.
local function mode(name, d, learn)
  local field = name .. "|" .. provider
  local current = redis.call("HGET", key, field)
  if learn then
    local count = redis.call("HINCRBY", key, field .. ":" .. d, 1)
    if not current or count > tonumber(redis.call("HGET", key, field .. "_n") or "0") then
      redis.call("HSET", key, field, d, field .. "_n", count)
      current = d
    end
  end
  return current and tonumber(current) or nil
end

local ep, ec
if declared ~= "" then
  local sp, sc = string.match(declared, "^(-?%d+):(-?%d+)$")
  ep, ec = tonumber(sp), tonumber(sc)
else
  ep = mode("pm", p, in_window)
  ec = mode("cm", c, in_window and ended)
end

local match = 1
if ep ~= nil and p ~= ep then match = 0 end
if ec ~= nil and not (c == ec or (not ended and c == ec + 1)) then match = 0 end
local mismatches
if match == 0 and in_window then
  mismatches = redis.call("HINCRBY", key, "miss", 1)
else
  mismatches = tonumber(redis.call("HGET", key, "miss") or "0")
end
redis.call("EXPIRE", key, ttl_s)
return {match, ep or p, ec or c, mismatches, mismatches > allowed and 1 or 0}
