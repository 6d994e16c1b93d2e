"""One batch result becomes a row exactly as a live answer does: prepare (the prompt rendered and
counted again), rebuild with its self-check, settle by the request's recorded lease. Its cost is its
tokens × the batch price (a per-result cost is not documented; the batch's ``usage.cost`` is the
charge, reconciled against the sum of these in ``poll.py``)."""

from __future__ import annotations

import logging
from typing import Any

from common.batches import Intent
from common.budget import Price
from common.config import WorkerView
from common.contract import FAIL_BATCH_ERROR, FAIL_INTERNAL, FAIL_TOKEN_MISMATCH
from common.errors import PromptFailed, TokenMismatch, UpstreamError
from common.stats import DatasetStats
from workers.fleet.context import WorkerContext
from workers.pipeline.batch import records
from workers.pipeline.batch.submit import batch_client
from workers.pipeline.job import Job, prepare, rebuild_row, settle
from workers.upstreams.upstream import Answer

log = logging.getLogger(__name__)


def row_cost(answer: Answer, price: Price | None) -> float:
    if price is None:
        return 0.0
    u = answer.usage
    return u["prompt_tokens"] * price.prompt + u["completion_tokens"] * price.completion + price.request


def settle_result(ctx: WorkerContext, view: WorkerView, intent: Intent, item: records.Item,
                  result: dict[str, Any]) -> tuple[str, float]:
    """The result's outcome word (kept, duplicate, failed) and the row cost counted for it."""
    job = Job(ctx, item.payload)
    job.lease, job.attempts = item.lease, 1
    stats = DatasetStats(ctx.redis, intent.dataset)
    try:
        answer = batch_client(ctx).answer(result, intent.model)
    except UpstreamError as exc:
        # Not billed (a failed request is not); the next run asks it again (not resubmitted in this one).
        stats.record_batch(batch_failed=1)
        return str(job.fail(FAIL_BATCH_ERROR, f"{exc.reason}: {exc.detail}")), 0.0
    price = Price.of(view.batch.pricing if view.batch is not None else None)
    cost = row_cost(answer, price)
    answer.usage["cost"] = cost
    job.billed_usd, job.usage = cost, answer.usage
    stats.record_batch(batch_results=1, batch_rows_cost_usd=cost)
    try:
        prepared = prepare(job)
        rebuilt = rebuild_row(job, prepared, answer)
    except TokenMismatch as exc:
        return str(job.fail(FAIL_TOKEN_MISMATCH, str(exc))), cost
    except PromptFailed as failed:
        return str(job.fail(failed.reason, failed.detail)), cost
    except Exception as exc:
        log.exception("%s/%s batch result: internal error", job.dataset, job.pid)
        return str(job.fail(FAIL_INTERNAL, f"{type(exc).__name__}: {exc}")), cost
    return str(settle(job, answer, rebuilt)), cost
