"""Batch mode, after the POST: any worker polls the open batches and settles their results.

Every second each worker looks at the open batches (``keys.BATCHES_OPEN``) and takes the poll of
each one nobody holds (``records.take_poll``: SET NX PX for ``batch_poll_s``, which is also the
poll's period). A poller that dies loses nothing: its poll lease lapses and another worker takes the
batch where the record (and the ``handled`` set) says it stood.

- ``posting`` (the intent was written, the batch id never recorded: its worker died or its POST had
  no answer): ``GET /api/v1/batches?created_after=`` the intent's time; an unclaimed batch of the same
  model and request count is ours (claimed once, ``BATCH_CLAIMS``). Only when none is there is the
  intent posted again: a crash between POST and record never bills a second batch.
- ``submitted``: ``GET /api/v1/batches/{id}``; once terminal, every result settles through the live
  path's rebuild, self-check and settle (``results.py``): token-exact rows, exactly once (the
  budget's settle, by the lease recorded with the request). A failed request fails with its reason
  (``batch_error``: the next run asks it again; it is not resubmitted in this run). An expired
  batch's unanswered requests, and the innocent requests of a batch that failed validation, are
  released (their holds freed, the prompts asked again by the producer's sweep); the request the
  validation named fails ``batch_invalid``. The batch's ``usage.cost`` is counted beside the rows'
  tokens × batch price (``batch_cost_usd`` vs ``batch_rows_cost_usd``: the difference is reported).
  Once closed, the batch is deleted at OpenRouter (its stored requests and results purged).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import gevent
import gevent.pool
from celery import bootsteps
from celery.worker.control import inspect_command

from common.batches import DONE, POSTING, SUBMITTED, Intent, load, open_batches, open_intents, summary
from common.budget import Budget
from common.contract import FAIL_BATCH_INVALID
from common.errors import BatchRefused, BatchSubmitError, ConfigError, LostPoll
from common.stats import DatasetStats
from workers import WORKER_ID
from workers.fleet import writes
from workers.fleet.context import WorkerContext, context
from workers.pipeline.batch import records
from workers.pipeline.batch.results import settle_result
from workers.pipeline.batch.submit import batch_client, body_of, poll_ms, posting_lease_ms
from workers.upstreams.openrouter_batch import TERMINAL, BatchClient

log = logging.getLogger(__name__)

#: How often a worker looks for batches to poll.
TICK_S = 1.0
#: A poll that settles results holds the batch this long, renewed as it goes.
SETTLE_LEASE_MS = 120_000
#: Results settled between two renewals of the poll lease and two marks of the handled set.
SETTLE_STEP = 50
#: Results of one batch settling at once (each a greenlet: prepare, rebuild, settle).
SETTLE_CONCURRENCY = 200
#: A batch listed this long before the intent's own clock still counts as a candidate (clock skew).
CLOCK_SLACK_S = 5.0
#: Open batches a worker's ``stats`` lists one by one (oldest first); the summary counts them all.
STATS_BATCHES = 100

OWNER = f"{WORKER_ID}:{uuid.uuid4().hex[:8]}"


def poll_once(ctx: WorkerContext) -> int:
    """One look at every open batch; returns how many this worker polled."""
    polled = 0
    for intent_id in open_intents(ctx.redis):
        intent = load(ctx.redis, intent_id)
        if intent is None or intent.state == DONE:
            continue
        try:
            view = ctx.run(intent.run)
        except ConfigError:
            continue  # another run's batch, in a Redis this worker serves: not ours to settle
        if not records.take_poll(ctx.redis, intent_id, OWNER, poll_ms(view)):
            continue
        polled += 1
        try:
            if intent.state == POSTING:
                _recover(ctx, intent)
            elif intent.state == SUBMITTED:
                _poll(ctx, intent)
        except LostPoll:
            log.warning("batch %s (%s): poll lease lapsed mid-settle; the next poller goes on", intent.id,
                        intent.batch_id)
        except Exception:
            log.exception("batch %s (%s): poll failed; the next poller goes on", intent.id, intent.batch_id)
    return polled


def _recover(ctx: WorkerContext, intent: Intent) -> None:
    """The intent's POST never got its batch id recorded: find the batch, or post it now."""
    api = batch_client(ctx)
    listed = api.listed(intent.created_s - CLOCK_SLACK_S)
    taken = records.claimed(ctx.redis, [str(b["id"]) for b in listed])
    candidates = sorted((b for b in listed if str(b["id"]) not in taken and b.get("model") == intent.model
                         and int((b.get("request_counts") or {}).get("total") or -1) == intent.n),
                        key=lambda b: float(b.get("created_at") or 0))
    items = records.items(ctx.redis, intent.id)
    if _rivals(ctx, intent) or len(candidates) > 1:
        # Model and size no longer tell whose batch is whose: only the custom_ids do, and they are
        # readable once a batch is terminal. Until then nothing is claimed and nothing is posted.
        waiting = [b for b in candidates if str(b.get("status")) not in TERMINAL]
        candidates = [b for b in candidates if b not in waiting and _names_ours(api, b, items)]
        if waiting and not candidates:
            log.info("%s batch %s: %d unclaimed batches of its model and size still run; it waits for their "
                     "custom_ids before claiming or posting", intent.dataset, intent.id, len(waiting))
            return
    for b in candidates:
        if records.record_submitted(ctx.redis, intent, str(b["id"])):
            records.hold_poll(ctx.redis, intent.id, OWNER, poll_ms(ctx.run(intent.run)))
            log.warning("%s batch %s: its POST's answer was lost; found it as %s (not posted again)",
                        intent.dataset, intent.id, b["id"])
            return
    view = ctx.run(intent.run)
    if not items:
        records.close(ctx.redis, intent, [], {"asked": 0})
        return
    records.hold_poll(ctx.redis, intent.id, OWNER, posting_lease_ms(ctx))
    requests_ = [{"custom_id": cid, "body": body_of(view, item.payload)} for cid, item in items.items()]
    try:
        with ctx.gate.slot(ttl_ms=posting_lease_ms(ctx), limits=view.throttle):
            remote = api.submit(intent.model, requests_)
    except BatchRefused as refused:
        for item in items.values():
            Budget(ctx.redis, intent.dataset).fail(item.payload["id"], item.lease, FAIL_BATCH_INVALID,
                                                   0, f"the Batch API refused the batch: {refused}",
                                                   where=item.payload["where"])
        records.close(ctx.redis, intent, [i.payload["id"] for i in items.values()], {"refused": str(refused)})
        return
    except BatchSubmitError as exc:
        log.warning("%s batch %s: %s: recovery tries again", intent.dataset, intent.id, exc)
        return
    records.record_submitted(ctx.redis, intent, str(remote["id"]))
    records.hold_poll(ctx.redis, intent.id, OWNER, poll_ms(view))
    DatasetStats(ctx.redis, intent.dataset).record_batch(batch_requests=len(requests_))
    log.warning("%s batch %s: not found at OpenRouter after its worker stopped; posted as %s",
                intent.dataset, intent.id, remote["id"])


def _rivals(ctx: WorkerContext, intent: Intent) -> bool:
    """Another intent lost its POST's answer too, with the same model and size: a batch found by
    model and size may be the other's (claiming it would post ours never, or post the other's twice)."""
    for other_id in open_intents(ctx.redis):
        other = load(ctx.redis, other_id) if other_id != intent.id else None
        if other is not None and other.state == POSTING and (other.model, other.n) == (intent.model, intent.n):
            return True
    return False


def _names_ours(api: BatchClient, batch: dict[str, Any], items: dict[str, records.Item]) -> bool:
    """A terminal batch holds our requests: a result's custom_id is one of ours, or its validation
    failure names one. A batch that answered nothing cannot be told, and costs nothing: not ours."""
    if str(batch.get("status")) == "failed":
        message = str((batch.get("error") or {}).get("message") or "")
        return any(cid in message for cid in items)
    first = next(iter(api.results(str(batch["id"]))), None)
    return first is not None and str(first.get("custom_id")) in items


def _poll(ctx: WorkerContext, intent: Intent) -> None:
    api = batch_client(ctx)
    remote = api.get(intent.batch_id)
    records.update_remote(ctx.redis, intent, remote)
    status = str(remote.get("status"))
    log.info("%s batch %s (%s): %s %s", intent.dataset, intent.id, intent.batch_id, status,
             remote.get("request_counts"))
    if status in TERMINAL:
        _settle(ctx, intent, remote)


def _settle(ctx: WorkerContext, intent: Intent, remote: dict[str, Any]) -> None:
    """Every request of a terminal batch gets its outcome or is given back."""
    client = ctx.redis
    if not records.hold_poll(client, intent.id, OWNER, SETTLE_LEASE_MS):
        # Our poll lease lapsed while we asked (a slow GET): another worker may be settling it now.
        log.info("%s batch %s: the poll passed to another worker before the settle", intent.dataset, intent.id)
        return
    view = ctx.run(intent.run)
    items = records.items(client, intent.id)
    done = records.handled(client, intent.id)
    stats = DatasetStats(client, intent.dataset)
    status = str(remote.get("status"))
    outcomes: dict[str, int] = {}
    rows_cost = 0.0
    step: list[str] = []

    def flush() -> None:
        records.mark_handled(client, intent.id, step)
        step.clear()
        if not records.hold_poll(client, intent.id, OWNER, SETTLE_LEASE_MS):
            raise LostPoll(intent.id)

    if status == "failed":
        message = str((remote.get("error") or {}).get("message") or "")
        for cid, item in items.items():
            if cid in done:
                continue
            budget = Budget(client, intent.dataset)
            if cid in message:
                budget.fail(item.payload["id"], item.lease, FAIL_BATCH_INVALID, 1, message,
                            where=item.payload["where"])
                stats.record_failure(FAIL_BATCH_INVALID)
                stats.record_batch(batch_failed=1)
                outcomes["failed"] = outcomes.get("failed", 0) + 1
            else:
                budget.release(item.payload["id"], item.lease)
                stats.record_batch(batch_returned=1)
                outcomes["returned"] = outcomes.get("returned", 0) + 1
            step.append(cid)
        flush()
    else:
        todo = [(r, items[str(r.get("custom_id"))]) for r in api_results(ctx, intent)
                if str(r.get("custom_id")) in items and str(r.get("custom_id")) not in done]
        # Each settle waits for its AOF fence (~1 s under appendfsync everysec): one after another a
        # 1,000-request batch took minutes; concurrent, they share the group commit's fences.
        pool = gevent.pool.Pool(SETTLE_CONCURRENCY)
        for (_, asked), (outcome, cost) in zip(todo, pool.imap(
                lambda pair: settle_result(ctx, view, intent, pair[1], pair[0]), todo), strict=True):
            cid = asked.custom_id
            rows_cost += cost
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            done.add(cid)
            step.append(cid)
            if len(step) >= SETTLE_STEP:
                flush()
        flush()
        # An expired batch's unanswered requests (or any the results left out): asked again.
        rest = [item for cid, item in items.items() if cid not in done]
        budget = Budget(client, intent.dataset)
        pool.map(lambda item: budget.release(item.payload["id"], item.lease), rest)
        if rest:
            stats.record_batch(batch_returned=len(rest))
            outcomes["returned"] = outcomes.get("returned", 0) + len(rest)
        step.extend(item.custom_id for item in rest)
        flush()
    cost = float((remote.get("usage") or {}).get("cost") or 0.0)
    stats.record_batch(batch_cost_usd=cost)
    summary = {"status": status, "outcomes": outcomes, "cost_usd": cost, "rows_cost_usd": round(rows_cost, 9),
               "difference_usd": round(cost - rows_cost, 9), "settled_s": round(time.time(), 3)}
    records.close(client, intent, [i.payload["id"] for i in items.values()], summary)
    log.info("%s batch %s (%s) %s: %s; cost $%.6f, rows $%.6f (difference $%.6f)", intent.dataset, intent.id,
             intent.batch_id, status, outcomes, cost, rows_cost, cost - rows_cost)
    _purge(ctx, intent)


def _purge(ctx: WorkerContext, intent: Intent) -> None:
    """A settled batch's requests and answers are not left stored at OpenRouter (the rows and the
    record's summary keep what the run needs). Only after the close: a DELETE never races a settle,
    and one that fails (or a worker that dies first) costs storage there, not a row here."""
    try:
        batch_client(ctx).delete(intent.batch_id)
    except Exception as exc:
        log.warning("%s batch %s (%s): not deleted at OpenRouter: %s", intent.dataset, intent.id, intent.batch_id,
                    exc)


def api_results(ctx: WorkerContext, intent: Intent) -> Any:
    return batch_client(ctx).results(intent.batch_id)


class PollBatches(bootsteps.StartStopStep):
    """The consumer's timer starts one poll greenlet a second when none is running."""

    requires = {"celery.worker.consumer.connection:Connection"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None
        self._poll: gevent.Greenlet | None = None

    def start(self, c: Any) -> None:
        self._timer = c.timer.call_repeatedly(TICK_S, self.tick, (), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def info(self, c: Any) -> dict[str, Any]:
        # Celery builds a worker's ``stats`` from every step's info; Flower's worker page shows the
        # keys it does not know in its "Other" tab and /api/workers returns them: Flower's place
        # for the fleet's open batches (kept in Redis, so every worker shows all of them).
        return stats_of(context().redis, STATS_BATCHES)

    def tick(self) -> None:
        if writes.refusing() or (self._poll is not None and not self._poll.dead):
            return
        self._poll = gevent.spawn(_poll_quietly)


def _poll_quietly() -> None:
    try:
        poll_once(context())
    except Exception as exc:  # Redis away: the next tick tries again
        log.warning("batch poll: %s", exc)


def stats_of(client: Any, limit: int | None = None) -> dict[str, Any]:
    """``open_batches``: one line for the fleet's open batches; ``open_batch_list``: each one (the
    ``limit`` oldest): batch id, dataset, requests, age, state. A Redis that does not answer is
    said, not raised: a failed stats call would blank the whole worker in Flower."""
    try:
        batches = sorted(open_batches(client), key=lambda b: -b["age_s"])
    except Exception as exc:
        return {"open_batches": f"unknown (Redis: {exc})", "open_batch_list": []}
    shown = [{"batch_id": b["batch_id"] or "(posting)", "dataset": b["dataset"], "requests": b["requests"],
              "age_s": b["age_s"], "state": b["status"], "completed": b["completed"], "failed": b["failed"]}
             for b in batches[:limit]]
    return {"open_batches": summary(batches), "open_batch_list": shown}


@inspect_command(name="open_batches")
def _inspect_open_batches(state: Any, **_: Any) -> dict[str, Any]:
    """``celery -A workers inspect open_batches``: every open batch of the fleet."""
    return stats_of(context().redis)
