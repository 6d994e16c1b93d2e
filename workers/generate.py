"""One prompt, start to end: reserve budget → call OpenRouter → rebuild tokens → settle.

Every way out of here leaves the prompt kept, failed-with-reason, skipped (budget or stop), or
handed back for a later delivery; one log line per step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import gevent
import msgpack
import redis

from common.budget import Budget
from common.contract import (
    CONTRACT_VERSION,
    FAIL_INTERNAL,
    FAIL_RETRIES_EXHAUSTED,
    FAIL_TOKEN_MISMATCH,
    FAIL_UPSTREAM_FATAL,
    STAT_BILLED_COMPLETION,
    STAT_BILLED_PROMPT,
    STAT_BILLED_REASONING,
    STAT_COST_MICRO_USD,
    STAT_DUPLICATES,
    STAT_REQUESTS,
    STAT_SKIPPED,
    ResultRow,
    TaskPayload,
)
from common.errors import FatalUpstreamError, RetryableUpstreamError, TokenMismatch, UpstreamError
from common.redis_client import UNREACHABLE, deadline
from workers.context import RunView, WorkerContext
from workers.openrouter import Completion
from workers.rebuild import RebuiltRow, answer_from_message, rebuild
from workers.retry import backoff_s
from workers.spool import USAGE_WAIT_S, fail_or_spool, settle_or_spool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Busy:
    """Another delivery of the same prompt holds a live lease: try again after ``wait_s``."""

    wait_s: float


#: 401 bad key, 402 out of credits (without Retry-After): the account, not the prompt, is at fault.
ACCOUNT_REFUSED_STATUSES = frozenset({401, 402})
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"

#: How often a request parked by a full budget asks again.
ADMISSION_POLL_S = 1.0

#: Slack on a lease beyond one attempt and one backoff: connect time, rebuild, a Redis blip.
LEASE_SLACK_S = 10.0


def lease_ttl_ms(length: dict[str, Any], retry: dict[str, Any]) -> int:
    """How long one attempt can hold a prompt. The holder renews before each retry, so a worker
    killed mid-request frees its prompts one attempt later, not after every retry's worth."""
    one_attempt_s = float(length["timeout_s"]) * 1.2 + float(retry["backoff_max_s"]) + LEASE_SLACK_S
    return int(one_attempt_s * 1000)


def request_body(view: RunView, payload: TaskPayload, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {**view.request_body, "model": view.model["name"], "max_tokens": max_tokens}
    body["messages"] = payload["messages"]
    if payload.get("tools"):
        body["tools"] = payload["tools"]
    return body


def _record_usage(ctx: WorkerContext, stats_key: str, completion: Completion) -> None:
    usage = completion.usage
    pipe = ctx.redis.pipeline(transaction=False)
    pipe.hincrby(stats_key, STAT_REQUESTS, 1)
    pipe.hincrby(stats_key, STAT_BILLED_PROMPT, usage["prompt_tokens"])
    pipe.hincrby(stats_key, STAT_BILLED_COMPLETION, usage["completion_tokens"])
    pipe.hincrby(stats_key, STAT_BILLED_REASONING, usage["reasoning_tokens"])
    pipe.hincrby(stats_key, STAT_COST_MICRO_USD, round(usage["cost"] * 1e6))
    # Report counters are not worth the paid answer: while Redis is away they give way to the
    # settle, which has the lease's time to land or be spooled (workers/spool.py).
    try:
        with deadline(USAGE_WAIT_S):
            pipe.execute()
    except UNREACHABLE as exc:
        log.warning("usage of %s not counted, Redis unreachable: %s", completion.generation_id, exc)


def _row(payload: TaskPayload, rebuilt: RebuiltRow, completion: Completion, attempts: int) -> ResultRow:
    row: ResultRow = {
        "id": payload["id"],
        "conversations": [*payload["messages"], rebuilt.assistant_message],
        "input_ids": rebuilt.input_ids,
        "loss_mask": rebuilt.loss_mask,
        "num_tokens": rebuilt.completion_tokens,
        "finish_reason": completion.finish_reason,
        "reasoning_end": rebuilt.reasoning_end,
        "usage": completion.usage,
        "provider": completion.provider,
        "model": completion.model,
        "generation_id": completion.generation_id,
        "attempts": attempts,
        "where": payload["where"],
    }
    if tools := payload.get("tools"):
        row["tools"] = tools
    return row


def generate(ctx: WorkerContext, payload: TaskPayload) -> str | Busy:
    """Run one prompt; returns the outcome word (kept, failed, duplicate, skipped:…, done) or Busy."""
    if payload.get("v") != CONTRACT_VERSION:
        raise ValueError(f"task contract version {payload.get('v')!r}, this worker speaks {CONTRACT_VERSION}")
    started = time.monotonic()
    pid, dataset = payload["id"], payload["dataset"]
    view = ctx.run(payload["run"])
    length, retry = view.length(dataset), view.retry
    budget = Budget(ctx.redis, dataset)
    lease = uuid.uuid4().hex

    ttl_ms = lease_ttl_ms(length, retry)
    prior = int(length.get("estimate_tokens") or length["max_tokens"])
    admission = budget.reserve(pid, lease, ttl_ms=ttl_ms, prior_estimate=prior)
    while admission.status == "wait":
        # The budget is committed to requests in flight whose size is still a guess: a greenlet
        # costs nothing to park, and re-asking is one Lua call.
        gevent.sleep(ADMISSION_POLL_S * random.uniform(0.5, 1.5))
        admission = budget.reserve(pid, lease, ttl_ms=ttl_ms, prior_estimate=prior)
    log.info("%s/%s reserve: %s %d", dataset, pid, admission.status, admission.value)
    if admission.status == "busy":
        return Busy(wait_s=min(60.0, admission.value / 1000 + 1))
    if admission.status in ("stopped", "over"):
        ctx.redis.hincrby(budget.keys.stats, STAT_SKIPPED, 1)
        return f"skipped:{admission.status}"
    if admission.status in ("done", "halted"):
        return admission.status

    attempts = 0
    try:
        target = ctx.tokenizer(view)
        body = request_body(view, payload, int(length["max_tokens"]))
        completion, attempts = _call_with_retries(ctx, budget, lease, body, payload, length, retry)
        if isinstance(completion, str):
            return completion
        answer = answer_from_message(completion.message, completion.finish_reason)
        # Tokenizing a 32k-token answer is CPU work: a real thread keeps the hub serving others.
        rebuilt = gevent.get_hub().threadpool.apply(
            rebuild, (target, payload["messages"], payload.get("tools"), answer)
        )
    except TokenMismatch as exc:
        _fail(ctx, budget, pid, lease, FAIL_TOKEN_MISMATCH, attempts, str(exc))
        log.warning("%s/%s rebuild: token mismatch: %s", dataset, pid, exc)
        return "failed"
    except _Failed as failed:
        _fail(ctx, budget, pid, lease, failed.reason, failed.attempts, failed.detail)
        log.warning("%s/%s failed: %s after %d attempts: %s", dataset, pid, failed.reason, failed.attempts,
                    failed.detail)
        return "failed"
    except (redis.RedisError, gevent.GreenletExit, KeyboardInterrupt, SystemExit):
        # Not the prompt's fault (Redis gone, worker shutting down): give the admission back so the
        # next delivery can take it at once instead of waiting for the lease to expire.
        with contextlib.suppress(Exception):
            budget.release(pid, lease)
        raise
    except Exception as exc:
        # A bug or an answer nobody foresaw: the prompt gets an outcome with the evidence, instead
        # of vanishing from the dataset's accounting.
        log.exception("%s/%s internal error", dataset, pid)
        _fail(ctx, budget, pid, lease, FAIL_INTERNAL, attempts, f"{type(exc).__name__}: {exc}")
        return "failed"

    row = _row(payload, rebuilt, completion, attempts)
    settled = settle_or_spool(ctx.redis, ctx.settings.spool_dir, budget, pid, lease, rebuilt.completion_tokens,
                              msgpack.packb(row, use_bin_type=True), within_s=LEASE_SLACK_S)
    if settled == "duplicate":
        ctx.redis.hincrby(budget.keys.stats, STAT_DUPLICATES, 1)
    log.info(
        "%s/%s settle: %s tokens=%d attempts=%d finish=%s %.1fs",
        dataset, pid, settled, rebuilt.completion_tokens, attempts,
        completion.finish_reason, time.monotonic() - started,
    )
    return settled


def _fail(ctx: WorkerContext, budget: Budget, pid: str, lease: str, reason: str, attempts: int, detail: str) -> None:
    """Record the failure (spooled while Redis is away) and count it."""
    if fail_or_spool(ctx.redis, ctx.settings.spool_dir, budget, pid, lease, reason, attempts, detail,
                     within_s=LEASE_SLACK_S) != "spooled":
        ctx.redis.hincrby(budget.keys.stats, f"fail:{reason}", 1)


class _Failed(Exception):
    def __init__(self, reason: str, attempts: int, detail: str) -> None:
        super().__init__(reason)
        self.reason, self.attempts, self.detail = reason, attempts, detail


def _call_with_retries(
    ctx: WorkerContext,
    budget: Budget,
    lease: str,
    body: dict[str, Any],
    payload: TaskPayload,
    length: dict[str, Any],
    retry: dict[str, Any],
) -> tuple[Completion | str, int]:
    """The upstream call with retries. Before each retry the lease is renewed; when that says the
    dataset was stopped (or another delivery kept the prompt) the outcome word comes back instead."""
    max_attempts = int(retry["max_attempts"])
    dataset, pid = payload["dataset"], payload["id"]
    for attempt in range(1, max_attempts + 1):
        t0 = time.monotonic()
        try:
            completion = ctx.client.complete(body, timeout_s=float(length["timeout_s"]))
        except UpstreamError as exc:
            ctx.redis.hincrby(budget.keys.stats, f"err:{exc.reason}", 1)
            log.info("%s/%s call %d: %s (%.1fs)", dataset, pid, attempt, exc.reason, time.monotonic() - t0)
            if exc.status in ACCOUNT_REFUSED_STATUSES and not exc.retryable:
                # A bad key or an empty account fails every prompt alike: marking them all failed
                # would burn the dataset. Halt the fleet instead; the prompt keeps no outcome.
                budget.halt(exc.reason, str(exc), WORKER_ID)
                budget.release(pid, lease)
                log.critical("%s/%s: OpenRouter refused the account (%s): halting the fleet", dataset, pid, exc)
                return "halted", attempt
            if isinstance(exc, FatalUpstreamError) or not isinstance(exc, RetryableUpstreamError):
                raise _Failed(FAIL_UPSTREAM_FATAL, attempt, str(exc)) from None
            if attempt == max_attempts:
                raise _Failed(FAIL_RETRIES_EXHAUSTED, attempt, str(exc)) from None
            gevent.sleep(
                backoff_s(attempt, exc, base_s=float(retry["backoff_base_s"]), max_s=float(retry["backoff_max_s"]))
            )
            # A stopped dataset makes no further upstream calls; an exhausted one still finishes
            # what it admitted (the admission was within budget).
            renewal = budget.reserve(pid, lease, ttl_ms=lease_ttl_ms(length, retry), prior_estimate=0)
            if renewal.status == "stopped":
                budget.release(pid, lease)
                return "skipped:stopped", attempt
            if renewal.status != "ok":  # done elsewhere, or our lease expired and was taken over
                return renewal.status, attempt
            continue
        _record_usage(ctx, budget.keys.stats, completion)
        log.info(
            "%s/%s call %d: %s completion_tokens=%s (%.1fs)", dataset, pid, attempt,
            completion.finish_reason, completion.usage["completion_tokens"], time.monotonic() - t0,
        )
        return completion, attempt
    raise AssertionError("unreachable")
