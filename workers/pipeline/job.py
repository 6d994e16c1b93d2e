"""The worker's contract: one ``Job`` and the five steps every mode composes.

A prompt's work is a ``Job`` (the state the steps share: its run's view, length class, lease,
attempts, what was billed) walked through five steps, each a public function here:

    prepare → reserve → call (with retries) → rebuild → settle

The modes are peers that compose these steps, chosen by the task's mode table
(``workers/pipeline/task.py``): one prompt (``workers/pipeline/generate.py``), every turn of a
conversation (``workers/pipeline/conversation.py``, each turn one prompt), and batch mode
(``workers/pipeline/batch/``: prepare and reserve at the task, rebuild and settle when its batch's
results come). A mode may leave a step out or take its place (batch mode's call is a batch), never
reach into another mode.

- **prepare**: render the prompt with the target's template and count its ids; a prompt over the
  length class's ``max_prompt_tokens`` or the model's context length is failed
  (``prompt_too_long``) before any money is spent. The ids are reused by the rebuild.
- **reserve**: ask the budget (``common/budget.py``) for admission with the request's worst case
  (``max_tokens``, and its dollars from the model's price and the prompt's tokens); parked while
  the budget is committed to requests that may land smaller. ``admission_outcome`` is the rule
  every mode applies to the budget's answer.
- **call**: one ``Upstream.complete`` per attempt, each inside a slot of the fleet-wide throttle
  (``workers/fleet/gate.py``); after a failed one ``workers/pipeline/retry.py`` decides (retry after a backoff,
  fail the prompt, halt the fleet); the lease is renewed before a retry and while waiting for a
  slot, so a stopped dataset makes no further calls, and again right before a send if what is left
  of it (by the worker's clock) would not outlive the attempt: a request never goes out on a lease
  another delivery could take while it is open.
- **rebuild**: the answer as token-exact ids, self-checked (``common/rebuild.py``); an
  engine's prompt ids unlike the rendered prompt halt the run (``engine_prompt_mismatch = "refuse"``).
- **settle**: the answer's billed usage is compared with the row's own counts (``common/usage_check.py``:
  a row that disagrees is flagged, too many in the run's first answers halt it), then the row is
  counted and handed to the collector, exactly once; the answer's cost is
  counted whatever becomes of the row (money spent is spent). While Redis is away, settle (and
  fail) retry within the lease's slack, then go to the local spool, replayed when Redis returns.

Every way out leaves the prompt kept, failed-with-reason (``Job.fail``), skipped (budget or stop),
halted (``halt_run``: no outcome, the next run asks again) or handed back for a later delivery
(``Busy``); one log line per step.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import gevent
import msgpack
import redis

from common.budget import POLICY, Admission, Budget, Price, TurnKeep
from common.config import LengthClass, WorkerView
from common.contract import (
    FAIL_IN_FLIGHT_BUDGET,
    FAIL_INTERNAL,
    FAIL_PROMPT_TOO_LONG,
    HALT_ENGINE,
    HALT_USAGE,
    ResultRow,
    TaskPayload,
    Usage,
    halt_message,
)
from common.errors import (
    InFlightBudgetError,
    MisconfiguredError,
    PromptEnded,
    PromptFailed,
    UpstreamError,
)
from common.outcomes import SKIPPED, Outcome
from common.providers import UNKNOWN_QUANTIZATION, quantization_of, same_provider
from common.quality import quality_of
from common.rebuild import ENDED_FINISH_REASONS, RebuiltRow, RenderedPrompt, rebuild, render_prompt
from common.redis_client import REFUSED_WRITES, UNREACHABLE, deadline
from common.sampling import sampled
from common.stats import DatasetStats
from common.target import TargetTokenizer
from common.usage_check import UsageVerdict, check_usage, halt_text
from workers import WORKER_ID
from workers.fleet import writes
from workers.fleet.context import WorkerContext
from workers.fleet.send_room import process_room
from workers.fleet.spool import fail_or_spool, settle_or_spool
from workers.pipeline.engine_ids import prompt_refusal, rebuild_from_engine
from workers.pipeline.retry import RetryPolicy
from workers.upstreams.upstream import Answer, Request, Upstream

log = logging.getLogger(__name__)

T = TypeVar("T")


#: Slack on a lease beyond one attempt and one backoff: connect time, rebuild, a Redis blip.
LEASE_SLACK_S = 10.0
#: A renewal made only to keep a paid answer's lease alive waits at most this long for Redis.
LEASE_RENEW_WAIT_S = 2.0
#: An attempt is sent only while its lease has ``timeout_s`` plus this much left: the rebuild and a
#: Redis blip before the settle. A second under the lease's slack less the gate's keepalive period,
#: so a request that waited for its slot with Redis up needs no renewal of its own.
SEND_MARGIN_S = 4.0
#: While Redis cannot confirm the lease before a send, the attempt waits this long between tries.
SEND_RETRY_S = 1.0


@dataclass(frozen=True)
class Busy:
    """Another delivery of the same prompt holds a live lease: try again after ``wait_s``."""

    wait_s: float


#: A mode: how a task's prompt (or conversation) is worked, composing this module's steps; the
#: task's mode table (workers/pipeline/task.py) picks one per dataset.
Mode = Callable[[WorkerContext, TaskPayload], Outcome | Busy]


@dataclass(frozen=True)
class Prepared:
    """What the prepare step hands on: the target and the prompt as the model will see it."""

    target: TargetTokenizer
    prompt: RenderedPrompt

    @property
    def prompt_tokens(self) -> int:
        """Prompt ids counted with the target tokenizer (what a dollar reserve can price)."""
        return len(self.prompt.ids)


class TurnHook(Protocol):
    """A conversation's turn (``workers/pipeline/conversation.py``, regenerate = "all"): the payload's id is
    the row key; ``finish`` completes the row and says what is kept with it."""

    def finish(self, row: ResultRow, rebuilt: RebuiltRow, answer: Answer) -> TurnKeep: ...


class Job:
    """One prompt's state, shared by the steps: what a mode builds first and hands to each."""

    def __init__(self, ctx: WorkerContext, payload: TaskPayload) -> None:
        self.ctx, self.payload = ctx, payload
        self.pid, self.dataset, self.where = payload["id"], payload["dataset"], payload["where"]
        self.view: WorkerView = ctx.run(payload["run"])
        self.length: LengthClass = self.view.length(self.dataset)
        self.policy = RetryPolicy.from_config(self.view.retry)
        self.budget = Budget(ctx.redis, self.dataset)
        self.stats = DatasetStats(ctx.redis, self.dataset)
        self.lease = uuid.uuid4().hex
        #: When the lease was last set (monotonic), taken before the call that set it: the script
        #: dates a lease from the ``now_ms`` its call carries, and a call that waited out an outage
        #: carries the time it was made (the soak's lease "renewed" already lapsed). None: not yet.
        self.lease_set_at: float | None = None
        self.attempts = 0
        #: What the upstream billed for this prompt so far: every way out passes it to the budget.
        self.billed_usd = 0.0
        #: The last answer's counters, not yet in the dataset's stats: they travel with the settle
        #: or fail (one round trip less per row), or the release on any other way out.
        self.usage: Usage | None = None
        self.started = time.monotonic()
        #: When the current attempt's request left (monotonic).
        self.sent_at = self.started

    @property
    def ttl_ms(self) -> int:
        """How long one attempt can hold the prompt. The holder renews before each retry, so a
        worker killed mid-request frees its prompts one attempt later, not after every retry's.

        Sized to outlive any attempt, not renewed during one: an attempt ends within ``timeout_s``
        of its start, whatever the upstream does (``workers/upstreams/openrouter.py``), and starts at most
        ``gate.KEEPALIVE_EVERY_S`` (5 s) after the lease was last set (the reserve, the renewal
        before a retry, or the gate's keepalive while it waited for a slot). So the lease outlives
        a live attempt by at least 0.2 × timeout_s + backoff_max_s + 5 s. Only a wait with no
        attempt open (a Retry-After beyond backoff_max_s) can outlast it, and the renewal after it
        answers ``lost`` if another delivery took the prompt meanwhile: then nothing is sent.
        A renewal that waited out a Redis outage sets a lease already lapsed (the script dates it
        from the call's own clock): ``_lease_for_send`` checks what is left right before sending."""
        return int((self.policy.attempt_window_s(self.length.timeout_s) + LEASE_SLACK_S) * 1000)

    def lease_left_s(self) -> float:
        """What is surely left of the lease, by this process's clock (0: not set)."""
        if self.lease_set_at is None:
            return 0.0
        return self.lease_set_at + self.ttl_ms / 1000 - time.monotonic()

    def renew(self) -> Outcome:
        """The budget's ``renew``, remembering when a lease it extended was set."""
        t0 = time.monotonic()
        renewal = self.budget.renew(self.pid, self.lease, ttl_ms=self.ttl_ms)
        if renewal is Outcome.OK:
            self.lease_set_at = t0
        return renewal

    def fail(self, reason: str, detail: str) -> Outcome:
        """Record the failure; while Redis is away it waits in the spool (workers/fleet/spool.py)."""
        usage, self.usage = self.usage, None
        recorded = fail_or_spool(self.ctx.redis, self.ctx.settings.spool_dir, self.payload["run"], self.budget,
                                 self.pid, self.lease, reason, self.attempts, detail, where=self.where,
                                 cost_usd=self.billed_usd, within_s=LEASE_SLACK_S, usage=usage)
        if recorded is not Outcome.SPOOLED:
            self.stats.record_failure(reason)
        log.warning("%s/%s failed: %s after %d attempts: %s", self.dataset, self.pid, reason, self.attempts, detail)
        return Outcome.FAILED


# --- 1. prepare ---------------------------------------------------------------------------------


def prepare(job: Job) -> Prepared:
    """Render and count the prompt; raise ``PromptFailed(prompt_too_long)`` when it cannot fit."""
    target = job.ctx.tokenizer(job.view)
    try:
        prompt = _off_hub(render_prompt, (target, job.payload["messages"], job.payload.get("tools")),
                          _chars(job.payload["messages"]) + (1000 if job.payload.get("tools") else 0))
    except Exception as exc:  # a template that cannot render this conversation: the row's problem
        detail = f"{job.where}: the chat template cannot render it: {type(exc).__name__}: {exc}"
        raise PromptFailed(FAIL_INTERNAL, detail) from None
    prepared = Prepared(target, prompt)
    n, max_tokens = prepared.prompt_tokens, job.length.max_tokens
    limit, context = job.length.max_prompt_tokens, job.view.model.context_length
    length_name = job.view.datasets[job.dataset]
    if limit is not None and n > limit:
        raise PromptFailed(FAIL_PROMPT_TOO_LONG,
                      f"{job.where}: prompt is {n:,} tokens, over lengths.{length_name}.max_prompt_tokens = {limit:,}")
    if context is not None and n + max_tokens > context:
        raise PromptFailed(FAIL_PROMPT_TOO_LONG,
                      f"{job.where}: prompt {n:,} + max_tokens {max_tokens:,} = {n + max_tokens:,} tokens, over "
                      f"model.context_length = {context:,}")
    log.info("%s/%s prepare: %d prompt tokens", job.dataset, job.pid, n)
    return prepared


# --- 2. reserve ---------------------------------------------------------------------------------


def reserve(job: Job, prepared: Prepared) -> Outcome | Busy | None:
    """Admission; None when admitted, else the outcome."""
    ask = POLICY.ask(max_tokens=job.length.max_tokens, estimate_tokens=job.length.estimate_tokens,
                     prompt_tokens=prepared.prompt_tokens, price=Price.of(job.view.model.pricing))
    t0 = time.monotonic()
    admission = job.budget.reserve(job.pid, job.lease, ttl_ms=job.ttl_ms, ask=ask)
    while admission.status is Outcome.WAIT:
        # The budget is committed to requests in flight that may land smaller: a greenlet costs
        # nothing to park, and re-asking is one Lua call.
        gevent.sleep(POLICY.wait_poll_s * random.uniform(0.5, 1.5))
        t0 = time.monotonic()
        admission = job.budget.reserve(job.pid, job.lease, ttl_ms=job.ttl_ms, ask=ask)
    if admission.status is Outcome.OK:
        job.lease_set_at = t0
    log.info("%s/%s reserve: %s %d", job.dataset, job.pid, admission.status, admission.value)
    return admission_outcome(job, admission)


def admission_outcome(job: Job, admission: Admission) -> Outcome | Busy | None:
    """What the budget's answer to a reserve means for the prompt, in every mode: None when
    admitted; Busy while another delivery holds it; the skip (counted) on a budget stop; else
    the budget's own word (done, halted)."""
    if admission.status is Outcome.OK:
        return None
    if admission.status is Outcome.BUSY:
        return Busy(wait_s=min(60.0, admission.value / 1000 + 1))
    if admission.status in SKIPPED:  # stopped, over
        job.stats.record_skipped()
        return SKIPPED[admission.status]
    return admission.status  # done, halted


# --- 3. call ------------------------------------------------------------------------------------


def call(job: Job, prepared: Prepared) -> Answer | Outcome:
    """The upstream call with retries; the outcome instead of an answer when the prompt ends
    without one (halted, skipped:stopped, done elsewhere, lost). Raises ``PromptFailed`` when it fails."""
    request = Request(
        model=job.view.model.name,
        messages=job.payload["messages"],
        tools=job.payload.get("tools"),
        max_tokens=job.length.max_tokens,
        params=sampled(job.view, job.dataset, job.payload["id"])[0],
        timeout_s=job.length.timeout_s,
        prompt_ids=prepared.prompt.ids,
        max_answer_bytes=job.ctx.settings.max_answer_bytes,
    )
    upstream = job.ctx.upstream(job.view)
    pricing = job.view.model.pricing
    # The request as the account's in-flight budget weighs it: its prompt and max_tokens at the price.
    worst_usd = (prepared.prompt_tokens * pricing.prompt + job.length.max_tokens * pricing.completion
                 + pricing.request) if pricing is not None else None
    refused_since: float | None = None  # the first in-flight budget 402 (its wait is capped)
    while True:
        t0 = time.monotonic()
        try:
            answer = _attempt(job, upstream, request, worst_usd)
        except PromptEnded as ended:
            return ended.outcome
        except UpstreamError as exc:
            if exc.usage is not None:  # billed though not usable (an answer too large to keep)
                job.billed_usd += exc.usage["cost"]
                job.usage = exc.usage
            job.stats.record_error(exc.reason)
            # The attempt's own time (what timeout_s bounds) apart from its wait for a slot.
            log.info("%s/%s call %d: %s (%.1fs, after %.1fs waiting to send)", job.dataset, job.pid, job.attempts,
                     exc.reason, time.monotonic() - job.sent_at, job.sent_at - t0)
            streak = job.stats.record_misconfigured(job.pid) if isinstance(exc, MisconfiguredError) else 0
            if isinstance(exc, InFlightBudgetError) and refused_since is None:
                refused_since = time.monotonic()
            waited_s = time.monotonic() - refused_since if refused_since is not None else 0.0
            decision = job.policy.decide(exc, job.attempts, misconfigured_prompts=streak, in_flight_waited_s=waited_s)
            if not decision.spends_attempt:
                job.attempts -= 1  # refused before it ran: not one of the prompt's attempts
            if decision.action == "halt":
                return _halt(job, decision.reason, exc)
            if decision.action == "fail":
                detail = str(exc)
                if decision.reason == FAIL_IN_FLIGHT_BUDGET:
                    detail = (f"refused for the account's in-flight budget for {waited_s:.0f} s ([retry] "
                              f"in_flight_wait_max_s = {job.policy.in_flight_wait_max_s:g}): {exc}")
                raise PromptFailed(decision.reason, detail) from None
            gevent.sleep(decision.delay_s)
            if (outcome := _renew(job)) is not None:
                return outcome
            continue
        job.billed_usd = answer.usage["cost"]
        # Counted with the settle or fail that follows; a cut answer is counted as one (``truncated``).
        job.usage = answer.usage.copy()
        if answer.finish_reason == "length":
            job.usage["truncated"] = 1
        log.info("%s/%s call %d: %s completion_tokens=%s (%.1fs, after %.1fs waiting to send)", job.dataset,
                 job.pid, job.attempts, answer.finish_reason, answer.usage["completion_tokens"],
                 time.monotonic() - job.sent_at, job.sent_at - t0)
        return answer


def _attempt(job: Job, upstream: Upstream, request: Request, worst_usd: float | None = None) -> Answer:
    """One attempt through the fleet-wide throttle (``workers/fleet/gate.py``): wait for a slot of the
    fleet's in-flight limit, renewing the lease meanwhile, and give it back with the outcome (a
    429/503 or the in-flight budget's 402 cuts the fleet's limit and its Retry-After pauses every
    worker; an answer's cost over ``worst_usd`` shrinks a limit the balance bounds)."""

    def keepalive() -> None:
        if (ended := _renew(job)) is not None:
            raise PromptEnded(ended)

    ttl_ms = int((job.length.timeout_s + LEASE_SLACK_S) * 1000)
    # The send room (workers/fleet/send_room.py) counts this task as needing a slot until it returns.
    # An upstream that can open its connections ahead (OpenRouter, the engines) does so while the
    # run's plan holds the requests; a test's in-process fake has nothing to open.
    warm = getattr(upstream, "warm", None)
    while True:
        sent = False
        try:
            with process_room().requesting(), job.ctx.gate.slot(ttl_ms=ttl_ms, limits=job.view.throttle,
                                                                keepalive=keepalive, warm=warm,
                                                                worst_usd=worst_usd) as receipt:
                if (ended := _lease_for_send(job)) is not None:
                    raise PromptEnded(ended)  # the slot goes back unused
                job.attempts += 1
                job.sent_at, sent = time.monotonic(), True
                answer = upstream.complete(request)
                receipt.cost_usd = answer.usage["cost"]
                return answer
        except UNREACHABLE as exc:
            if sent:  # not the lease check's
                raise
            log.warning("%s/%s lease not confirmed before sending (%s: %s): not sent, the slot is given back",
                        job.dataset, job.pid, type(exc).__name__, exc)
            gevent.sleep(SEND_RETRY_S)


def _lease_for_send(job: Job) -> Outcome | None:
    """Right before a request leaves: the lease must outlive the whole attempt, or another delivery
    could take the prompt while it is open. A lease a stale renewal set (one that waited out an
    outage, see ``Job.lease_set_at``) or that the slot's wait used up is renewed first, now; the
    outcome when that says the prompt is no longer ours. Raises ``UNREACHABLE`` when Redis
    cannot answer within LEASE_RENEW_WAIT_S: nothing is sent on a lease nobody could confirm."""
    need_s = job.length.timeout_s + SEND_MARGIN_S
    while (left_s := job.lease_left_s()) < need_s:
        log.info("%s/%s lease: %.1fs left, under the attempt's %.1fs: renewed before sending", job.dataset,
                 job.pid, left_s, need_s)
        with deadline(LEASE_RENEW_WAIT_S):
            if (ended := _renew(job)) is not None:
                return ended
    return None


def _renew(job: Job) -> Outcome | None:
    """Renew the lease before another attempt; the outcome when the prompt ends instead.

    A stopped dataset makes no further upstream calls; an exhausted one still finishes what it
    admitted (the admission was within budget)."""
    renewal = job.renew()
    if renewal is Outcome.STOPPED or renewal is Outcome.LOST:
        job.budget.release(job.pid, job.lease)
        return Outcome.SKIPPED_STOPPED if renewal is Outcome.STOPPED else Outcome.LOST
    if renewal is not Outcome.OK:  # halted, or done by another delivery
        return renewal
    return None


def keep_lease(job: Job) -> None:
    """While a paid answer waits for room: keep its lease alive so no other delivery asks again.
    Never raises: whatever the renewal says, the settle that follows decides (and spools)."""
    try:
        with deadline(LEASE_RENEW_WAIT_S):
            job.renew()
    except Exception as exc:
        log.warning("%s/%s lease not renewed while waiting for answer room: %s", job.dataset, job.pid, exc)


def _halt(job: Job, reason: str, exc: UpstreamError) -> Outcome:
    """Every prompt would fail alike: marking them all failed would burn the dataset. Halt the
    fleet instead; this prompt keeps no outcome and the next run asks it again. An error that
    names the server's own fix (an engine without ids) halts as the engine's, the fix at the end."""
    message = f"{exc.target} answered {exc.reason}: {exc.detail}" if isinstance(exc, MisconfiguredError) else exc.detail
    if isinstance(exc, MisconfiguredError) and exc.fix is not None:
        reason, message = HALT_ENGINE, halt_message(message, exc.fix)
    return halt_run(job, reason, message)


def halt_run(job: Job, reason: str, message: str) -> Outcome:
    """Halt the fleet; the prompt's admission goes back, with what its answer was billed (if one
    came), so the accounting stays exact."""
    job.budget.halt(reason, message, WORKER_ID)
    usage, job.usage = job.usage, None
    job.budget.release(job.pid, job.lease, cost_usd=job.billed_usd, usage=usage)
    log.critical("%s/%s: halting the fleet: %s: %s", job.dataset, job.pid, reason, message)
    return Outcome.HALTED


def refused_engine_prompt(job: Job, prepared: Prepared, answer: Answer, rebuilt: RebuiltRow) -> str | None:
    """``[model] engine_prompt_mismatch = "refuse"``: why the engine's prompt ids refuse the run
    (they are not the prompt the run's tokenizer renders: another chat template), or None."""
    check = rebuilt.engine_check
    if check is None or check["prompt_match"] or job.view.model.engine_prompt_mismatch != "refuse":
        return None
    return prompt_refusal(prepared.target, job.dataset, job.pid, job.where, answer.prompt_ids or [],
                          prepared.prompt.ids)


def refused_provider(job: Job, answer: Answer) -> str | None:
    """``providers = "pin"``: why an answer from another provider is refused (billed, not kept).
    OpenRouter honours ``provider.only`` with ``allow_fallbacks = false``; this holds the rows to it
    should a fallback happen anyway, or a gateway in between not pass the preference on."""
    pin = job.view.provider_pin
    if pin is None or same_provider(answer.provider, pin):
        return None
    return (f"{job.where}: answered by provider {answer.provider or '(unnamed)'!r}, not the pinned {pin!r} "
            "([request] providers = \"pin\")")


# --- 4. rebuild ---------------------------------------------------------------------------------


def rebuild_row(job: Job, prepared: Prepared, answer: Answer) -> RebuiltRow:
    """The answer as token-exact ids after the prepared prompt; raises ``TokenMismatch``."""
    # Tokenizing a 32k-token answer is CPU work: a real thread keeps the hub serving others.
    args = (prepared.target, job.payload["messages"], job.payload.get("tools"), answer)
    # An engine's ids are the row; the text rebuild becomes their cross-check (engine_ids.py).
    step = rebuild if answer.completion_ids is None else rebuild_from_engine
    size = len(answer.reasoning or "") + len(answer.content or "") + (1000 if answer.tool_calls else 0)
    rebuilt: RebuiltRow = _off_hub(step, args, size, {"prompt": prepared.prompt})
    return rebuilt


#: Text shorter than this is tokenized in the greenlet itself: a few hundred microseconds of hub
#: time cost less than handing the call to a pool thread and back (a thread wake-up, a GIL
#: hand-over and a hub notification each way: 8% of a busy worker's main thread at 300 ms).
INLINE_MAX_CHARS = 4096


def _chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) + len(str(m.get("reasoning_content") or "")) for m in messages)


def _off_hub(fn: Callable[..., T], args: tuple[Any, ...], chars: int, kwargs: dict[str, Any] | None = None) -> T:
    """``fn(*args)`` inline when its text is short, else in a real thread so a 32k-token answer
    never stalls the hub (the Rust tokenizer releases the GIL while it works)."""
    if chars <= INLINE_MAX_CHARS:
        return fn(*args, **(kwargs or {}))
    result: T = gevent.get_hub().threadpool.apply(fn, args, kwargs)
    return result


# --- 5. settle ----------------------------------------------------------------------------------


def settle(job: Job, answer: Answer, rebuilt: RebuiltRow, turn: TurnHook | None = None) -> Outcome:
    """Keep the row, unless another delivery did (duplicate) or the hard cap has no room left for
    it (discarded: its lease was reaped meanwhile; billed, and the task's outcome is failed,
    recorded as over_budget). The usage check's halt keeps no row: the answer is released, billed."""
    verdict = _check_usage(job, answer, rebuilt)
    if verdict is not None and verdict.over_limit and job.view.model.usage_check == "halt":
        # The prompt and its file's name: a long path would crowd the numbers out of the halt's line.
        where = f"{job.dataset}/{job.pid} ({job.where.rsplit('/', 1)[-1]})"
        return halt_run(job, HALT_USAGE, halt_text(verdict, job.view.model, where))
    row = _row(job.payload, rebuilt, answer, job.attempts, job.view)
    if verdict is not None:
        row["usage_check"] = verdict.row_field()
    # The repetition scan is ~35 ms for a 22k-word answer: a long one is scanned off the hub.
    if (mark := _off_hub(quality_of, (answer,), len(answer.content or "") + len(answer.reasoning or ""))) is not None:
        row["quality"] = mark
    keep = None if turn is None else turn.finish(row, rebuilt, answer)
    usage, job.usage = job.usage, None
    settled = settle_or_spool(job.ctx.redis, job.ctx.settings.spool_dir, job.payload["run"], job.budget, job.pid,
                              job.lease, rebuilt.completion_tokens, msgpack.packb(row, use_bin_type=True),
                              cost_usd=job.billed_usd, attempts=job.attempts, within_s=LEASE_SLACK_S, turn=keep,
                              usage=usage)
    if settled is Outcome.DUPLICATE:
        job.stats.record_duplicate()
    elif settled is Outcome.DISCARDED:
        job.stats.record_failure("over_budget")
    else:
        if rebuilt.engine_check is not None:
            job.stats.record_engine_check(rebuilt.engine_check["match"], rebuilt.engine_check["prompt_match"])
        if verdict is not None:
            job.stats.record_usage_check(verdict.match)
    log.info(
        "%s/%s settle: %s tokens=%d attempts=%d finish=%s %.1fs",
        job.dataset, job.pid, settled, rebuilt.completion_tokens, job.attempts,
        answer.finish_reason, time.monotonic() - job.started,
    )
    return Outcome.FAILED if settled is Outcome.DISCARDED else settled


def _check_usage(job: Job, answer: Answer, rebuilt: RebuiltRow) -> UsageVerdict | None:
    """The answer's billed usage against the row's prompt and completion ids; logged when they disagree.
    None while Redis cannot answer within LEASE_RENEW_WAIT_S: the row goes on unchecked to its settle,
    which spools it (the check is evidence, not accounting; the lease's slack is the settle's)."""
    try:
        with deadline(LEASE_RENEW_WAIT_S):
            verdict = check_usage(job.ctx.redis, job.payload["run"], job.view, answer.usage,
                                  prompt_tokens=rebuilt.prompt_tokens, completion_tokens=rebuilt.completion_tokens,
                                  ended=answer.finish_reason in ENDED_FINISH_REASONS, provider=answer.provider)
    except REFUSED_WRITES as exc:
        # Redis refusing writes is a state the worker says once (workers/fleet/writes.py) and waits
        # out; a line per answer here would bury it (test_worker_redis_refuses: one line per state).
        writes.refused(exc)
        log.debug("%s/%s usage not checked: Redis refuses writes", job.dataset, job.pid)
        return None
    except redis.RedisError as exc:
        log.warning("%s/%s usage not checked (Redis: %s: %s)", job.dataset, job.pid, type(exc).__name__, exc)
        return None
    if verdict is not None and not verdict.match:
        log.warning("%s/%s usage: billed - counted = %+d prompt, %+d completion tokens, expected %+d, %+d (%d "
                    "disagreeing of the run's first %d answers)", job.dataset, job.pid, verdict.prompt_diff,
                    verdict.completion_diff, verdict.expected_prompt, verdict.expected_completion,
                    verdict.mismatches, job.view.model.usage_check_answers)
    return verdict


def _row(payload: TaskPayload, rebuilt: RebuiltRow, answer: Answer, attempts: int, view: WorkerView) -> ResultRow:
    manifest, quantization = view.manifest, quantization_of(view.model.quantizations, answer.provider)
    row: ResultRow = {
        "id": payload["id"],
        "conversations": [*payload["messages"], rebuilt.assistant_message],
        "input_ids": rebuilt.input_ids,
        "loss_mask": rebuilt.loss_mask,
        "num_tokens": rebuilt.completion_tokens,
        "finish_reason": answer.finish_reason,
        "reasoning_end": rebuilt.reasoning_end,
        "usage": answer.usage,
        "provider": answer.provider,
        "model": answer.model,
        "generation_id": answer.generation_id,
        "attempts": attempts,
        "where": payload["where"],
        "manifest": manifest,
    }
    if quantization != UNKNOWN_QUANTIZATION:
        row["quantization"] = quantization
    if tools := payload.get("tools"):
        row["tools"] = tools
    if rebuilt.engine_check is not None:
        row["engine_check"] = rebuilt.engine_check
    if (recipe := sampled(view, payload["dataset"], payload["id"])[1]) is not None:
        row["sampling"] = recipe
    return row
