"""Single mode: one prompt (or one turn of a conversation) through the five steps of
``workers/pipeline/job.py`` in a row, live: prepare → reserve → call → rebuild → settle.

Every way out leaves the prompt kept, failed-with-reason, skipped (budget or stop), halted (no
outcome: the next run asks again) or handed back for a later delivery; one log line per step.
"""

from __future__ import annotations

import contextlib
import logging

import gevent
import redis

from common.contract import (
    CONTRACT_VERSION,
    FAIL_INTERNAL,
    FAIL_PROVIDER_REFUSED,
    FAIL_TOKEN_MISMATCH,
    HALT_ENGINE,
    TaskPayload,
)
from common.errors import PromptFailed, TokenMismatch
from common.outcomes import Outcome
from workers.fleet.answer_room import answer_bytes, answer_room
from workers.fleet.context import WorkerContext
from workers.pipeline.job import (
    Busy,
    Job,
    TurnHook,
    call,
    halt_run,
    keep_lease,
    prepare,
    rebuild_row,
    refused_engine_prompt,
    refused_provider,
    reserve,
    settle,
)

log = logging.getLogger(__name__)


def generate(ctx: WorkerContext, payload: TaskPayload, turn: TurnHook | None = None) -> Outcome | Busy:
    """Run one prompt (or, with ``turn``, one turn of a conversation); returns its outcome (kept,
    failed, duplicate, spooled, skipped:…, done, halted) or Busy."""
    if payload.get("v") != CONTRACT_VERSION:
        raise ValueError(f"task contract version {payload.get('v')!r}, this worker speaks {CONTRACT_VERSION}")
    job = Job(ctx, payload)
    try:
        prepared = prepare(job)
    except PromptFailed as refused:
        return job.fail(refused.reason, refused.detail)

    outcome = reserve(job, prepared)
    if outcome is not None:
        return outcome

    # An answer holds room of the worker's answer bytes (workers/fleet/answer_room.py) from its arrival to
    # the end of its settle or failure: what bounds the memory answers take while becoming rows.
    with contextlib.ExitStack() as room:
        try:
            answer = call(job, prepared)
            if answer is Outcome.LOST:
                return Busy(wait_s=1.0)  # our lease was reaped meanwhile: a fresh delivery asks the budget again
            if isinstance(answer, Outcome):
                return answer
            room.enter_context(answer_room(job.ctx.settings.answer_bytes_in_flight).holding(
                answer_bytes(answer), keepalive=lambda: keep_lease(job)))
            if (why := refused_provider(job, answer)) is not None:
                return job.fail(FAIL_PROVIDER_REFUSED, why)
            rebuilt = rebuild_row(job, prepared, answer)
            if (refusal := refused_engine_prompt(job, prepared, answer, rebuilt)) is not None:
                return halt_run(job, HALT_ENGINE, refusal)
        except TokenMismatch as exc:
            return job.fail(FAIL_TOKEN_MISMATCH, str(exc))
        except PromptFailed as failed:
            return job.fail(failed.reason, failed.detail)
        except (redis.RedisError, gevent.GreenletExit, KeyboardInterrupt, SystemExit):
            # Not the prompt's fault (Redis gone, worker shutting down): give the admission back so the
            # next delivery can take it at once instead of waiting for the lease to expire.
            # A billed answer's counters go with the release, once per lease (budget.lua).
            usage, job.usage = job.usage, None
            with contextlib.suppress(Exception):
                job.budget.release(job.pid, job.lease, cost_usd=job.billed_usd, usage=usage)
            raise
        except Exception as exc:
            # A bug or an answer nobody foresaw: the prompt gets an outcome with the evidence, instead
            # of vanishing from the dataset's accounting.
            log.exception("%s/%s internal error", job.dataset, job.pid)
            return job.fail(FAIL_INTERNAL, f"{type(exc).__name__}: {exc}")
        return settle(job, answer, rebuilt, turn)
