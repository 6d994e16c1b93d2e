"""Batch mode, the task's side: prepare and reserve each prompt as the live path does, gather the
process's prompts of a dataset into one batch, record the intent, POST it, record the batch id, then
let the tasks go (their messages are acked: the batch record holds them now).

- prepare: the live path's (render, count; ``prompt_too_long`` fails the prompt unsent, so one bad
  request never fails a batch).
- reserve: the live path's rule, the worst case priced at the **batch** price (tokens: once enough
  rows are kept, the round's statistical hold, common/budget.lua); a full budget parks
  the task (``wait``) as live, and a budget stop (``over``/``stopped``) submits nothing more. Once
  the room left is less than a full batch's worst cases, the task goes live instead (``tail.py``,
  ``[request] tail``): batches would only shrink from there, a batch latency per round.
- gather: up to ``[request] batch_size`` requests (≤ 5,000) and ``BATCH_MAX_BYTES``, or what came
  within ``batch_gather_s`` of the first.
- submit: ``records.record_intent`` (MULTI, fenced: leases renewed to outlive the batch, requests,
  prompts marked batched, this worker its poller) → ``POST`` inside a slot of the fleet's throttle
  (the plan's hold and a 429 pause apply) → ``records.record_submitted``. A 4xx created nothing: the
  prompts fail (``batch_invalid``), or the fleet halts when the model has no ``:batch`` endpoint.
  Any other failure may have created the batch: the intent stays ``posting`` and the poller that
  takes it over looks for it before posting again (``poll.py``).

A redelivered message of a prompt already in a batch (``DatasetKeys.batched``) is acked at once.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import gevent
import orjson
from gevent.event import AsyncResult

from common.batches import Intent
from common.budget import POLICY, Budget, Price
from common.config import BATCH_MAX_BYTES, WorkerView
from common.contract import FAIL_BATCH_INVALID, HALT_MISCONFIGURED, TaskPayload
from common.errors import BatchRefused, BatchSubmitError, ConfigError, PromptFailed
from common.keys import DatasetKeys
from common.outcomes import Outcome
from common.sampling import sampled
from common.stats import DatasetStats
from workers import WORKER_ID
from workers.fleet.context import WorkerContext
from workers.fleet.send_room import process_room
from workers.pipeline.batch import records, tail
from workers.pipeline.generate import generate
from workers.pipeline.job import Busy, Job, admission_outcome, prepare
from workers.upstreams.openrouter import request_body
from workers.upstreams.openrouter_batch import BatchClient
from workers.upstreams.upstream import Request

log = logging.getLogger(__name__)

#: Bytes a batch leaves unused below the API's limit: the envelope and JSON escapes.
BYTES_MARGIN = 1 << 20

_CLIENTS: dict[int, BatchClient] = {}


def batch_client(ctx: WorkerContext) -> BatchClient:
    """The process's Batch API client (OpenRouter's URL and key of the worker's environment)."""
    client = _CLIENTS.get(id(ctx))
    if client is None:
        s = ctx.settings
        if not s.openrouter_api_key:
            raise ConfigError("environment variable OPENROUTER_API_KEY is not set on this worker")
        client = _CLIENTS[id(ctx)] = BatchClient(s.openrouter_base_url, s.openrouter_api_key, app_url=s.app_url,
                                                 app_title=s.app_title, submit_timeout_s=s.batch_submit_timeout_s)
    return client


def poll_ms(view: WorkerView) -> int:
    """A batch's poll lease: the period of its polls (whoever takes it next polls it next)."""
    return int((view.batch.poll_s if view.batch is not None else 30.0) * 1000)


def posting_lease_ms(ctx: WorkerContext) -> int:
    """The intent's poll lease while its POST is on its way: no other worker recovers it before the
    POST has surely ended (its timeout, and a margin for the clock and the record after it)."""
    return int((ctx.settings.batch_submit_timeout_s * 1.5 + 5) * 1000)


def batch_price(view: WorkerView) -> Price | None:
    return Price.of(view.batch.pricing if view.batch is not None else None)


def body_of(view: WorkerView, payload: TaskPayload) -> dict[str, Any]:
    """The chat completions body of one batch request: the live request's, less what a batch names once."""
    length = view.length(payload["dataset"])
    params = sampled(view, payload["dataset"], payload["id"])[0]  # the prompt's recipe, as a live request's
    body = request_body(Request(model=view.model.name, messages=payload["messages"], tools=payload.get("tools"),
                                max_tokens=length.max_tokens, params=params, timeout_s=length.timeout_s))
    body.pop("stream", None)
    return body


@dataclass
class _Pending:
    job: Job
    item: records.Item
    body: dict[str, Any]
    size: int
    done: AsyncResult = field(default_factory=AsyncResult)


def submit(ctx: WorkerContext, payload: TaskPayload) -> Outcome | Busy:
    """One prompt of a batch-mode dataset: its outcome word now (failed, skipped, done…), or
    ``batched`` once its batch is recorded."""
    job = Job(ctx, payload)
    if ctx.redis.hexists(DatasetKeys(job.dataset).batched, job.pid):
        return Outcome.BATCHED  # a redelivery: the batch that holds it settles it
    try:
        prepared = prepare(job)
    except PromptFailed as refused:
        return job.fail(refused.reason, refused.detail)
    outcome = _reserve(job, prepared.prompt_tokens)
    if isinstance(outcome, _GoLive):
        log.info("%s/%s: the budget's tail, sent live", job.dataset, job.pid)
        live = generate(ctx, payload)
        if live is Outcome.KEPT:
            job.stats.record_batch(batch_tail_live=1)
        return live
    if outcome is not None:
        return outcome
    cid = records.custom_id(job.dataset, job.pid)
    body = {"custom_id": cid, "body": body_of(job.view, payload)}
    pending = _Pending(job, records.Item(cid, payload, job.lease), body, len(orjson.dumps(body)))
    return _gatherer(ctx, job.view, payload["run"], job.dataset).add(pending)


class _GoLive:
    """``_reserve``'s answer when the task belongs to the budget's live tail (nothing reserved)."""


_LIVE = _GoLive()


def _reserve(job: Job, prompt_tokens: int) -> Outcome | Busy | _GoLive | None:
    ask = POLICY.ask(max_tokens=job.length.max_tokens, estimate_tokens=job.length.estimate_tokens,
                     prompt_tokens=prompt_tokens, price=batch_price(job.view))
    if tail.goes_live(job.view, job.budget, ask.worst_tokens):
        return _LIVE
    t0 = time.monotonic()
    admission = job.budget.reserve(job.pid, job.lease, ttl_ms=job.ttl_ms, ask=ask, batch_round=True)
    while admission.status == Outcome.WAIT:
        # Waiting for a round to land holds no request slot: the worker may take other datasets' prompts.
        with process_room().parked():
            gevent.sleep(POLICY.wait_poll_s * random.uniform(0.5, 1.5))
        if tail.goes_live(job.view, job.budget, ask.worst_tokens):
            return _LIVE  # a wait holds nothing: the live path asks the budget afresh
        t0 = time.monotonic()
        admission = job.budget.reserve(job.pid, job.lease, ttl_ms=job.ttl_ms, ask=ask, batch_round=True)
    if admission.status == Outcome.OK:
        job.lease_set_at = t0
    log.info("%s/%s reserve (batch): %s %d", job.dataset, job.pid, admission.status, admission.value)
    return admission_outcome(job, admission)


class _Gatherer:
    """A process's requests of one dataset on their way into a batch."""

    def __init__(self, ctx: WorkerContext, view: WorkerView, run: str, dataset: str) -> None:
        assert view.batch is not None
        self.ctx, self.view, self.run, self.dataset = ctx, view, run, dataset
        self.size, self.gather_s = view.batch.size, view.batch.gather_s
        self.max_bytes = BATCH_MAX_BYTES - BYTES_MARGIN
        self.pending: list[_Pending] = []
        self.bytes = 0
        self.timer: gevent.Greenlet | None = None

    def add(self, p: _Pending) -> Outcome | Busy:
        if self.pending and self.bytes + p.size > self.max_bytes:
            self._flush()
        self.pending.append(p)
        self.bytes += p.size
        if len(self.pending) >= self.size:
            self._flush()
        elif self.timer is None:
            self.timer = gevent.spawn_later(self.gather_s, self._flush)
        result: Outcome | Busy = p.done.get()
        return result

    def _flush(self) -> None:
        if self.timer is not None and self.timer is not gevent.getcurrent():
            self.timer.kill(block=False)
        self.timer = None
        batch, self.pending, self.bytes = self.pending, [], 0
        if batch:
            gevent.spawn(self._submit, batch)

    def _submit(self, batch: list[_Pending]) -> None:
        try:
            outcomes = submit_batch(self.ctx, self.view, self.run, self.dataset, batch)
        except BaseException as exc:  # every waiting task must hear, or it waits forever
            log.exception("%s: batch of %d not submitted", self.dataset, len(batch))
            for p in batch:
                if not p.done.ready():
                    p.done.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            return
        for p in batch:
            p.done.set(outcomes.get(p.item.custom_id, Outcome.BATCHED))


_GATHERERS: dict[tuple[int, str, str], _Gatherer] = {}


def _gatherer(ctx: WorkerContext, view: WorkerView, run: str, dataset: str) -> _Gatherer:
    key = (id(ctx), run, dataset)
    g = _GATHERERS.get(key)
    if g is None:
        g = _GATHERERS[key] = _Gatherer(ctx, view, run, dataset)
    return g


def submit_batch(ctx: WorkerContext, view: WorkerView, run: str, dataset: str,
                 batch: list[_Pending]) -> dict[str, Outcome | Busy]:
    """Record the intent, POST, record the batch id. Returns the outcome of each custom_id that is
    not ``batched``."""
    client = ctx.redis
    intent = Intent(id=uuid.uuid4().hex, run=run, dataset=dataset, model=view.model.name, created_s=time.time(),
                    n=len(batch))
    owner = f"{WORKER_ID}:{uuid.uuid4().hex[:8]}"
    renewals = records.record_intent(client, intent, [p.item for p in batch], owner=owner,
                                     poll_ms=posting_lease_ms(ctx))
    outcomes: dict[str, Outcome | Busy] = {}
    dropped = []
    for p, renewal in zip(batch, renewals, strict=True):
        if renewal == Outcome.OK:
            continue
        dropped.append(p.item)
        if renewal in (Outcome.STOPPED, Outcome.LOST):
            p.job.budget.release(p.job.pid, p.job.lease)
        outcomes[p.item.custom_id] = (Outcome.SKIPPED_STOPPED if renewal == Outcome.STOPPED
                                      else Busy(wait_s=1.0) if renewal == Outcome.LOST else Outcome(renewal))
    intent.n -= len(dropped)
    records.drop(client, intent, dropped)
    asked = [p for p in batch if p.item.custom_id not in outcomes]
    if not asked:
        records.close(client, intent, [], {"asked": 0})
        return outcomes
    log.info("%s batch %s: %d requests recorded, posting", dataset, intent.id, len(asked))
    try:
        with ctx.gate.slot(ttl_ms=posting_lease_ms(ctx), limits=view.throttle):
            remote = batch_client(ctx).submit(view.model.name, [p.body for p in asked])
    except BatchRefused as refused:
        _refused(ctx, intent, asked, refused, outcomes)
        return outcomes
    except BatchSubmitError as exc:
        # It may exist and bill: never posted again before a look at the list (poll.py recovers it).
        log.warning("%s batch %s: %s: left for recovery", dataset, intent.id, exc)
        return outcomes
    if not records.record_submitted(client, intent, str(remote["id"])):
        log.error("%s batch %s: %s is claimed by another intent", dataset, intent.id, remote["id"])
    else:
        records.update_remote(client, intent, remote)  # its state (validating) is shown before the first poll
    # The posting lease gives way to the poll's period: the first poll comes one period after the POST.
    records.hold_poll(client, intent.id, owner, poll_ms(view))
    DatasetStats(client, dataset).record_batch(batch_requests=len(asked))
    log.info("%s batch %s: submitted as %s (%d requests, %s)", dataset, intent.id, remote["id"], len(asked),
             remote.get("status"))
    return outcomes


def _refused(ctx: WorkerContext, intent: Intent, asked: list[_Pending], refused: BatchRefused,
             outcomes: dict[str, Outcome | Busy]) -> None:
    """A 4xx: no batch exists. No :batch endpoint is the run's fault: halt, like a wrong model;
    anything else fails the batch's prompts with the API's words."""
    dataset = intent.dataset
    if ":batch endpoint" in refused.message:
        Budget(ctx.redis, dataset).halt(HALT_MISCONFIGURED, f"the Batch API refused model {intent.model!r}: "
                                        f"{refused.message}", WORKER_ID)
        for p in asked:
            p.job.budget.release(p.job.pid, p.job.lease)
            outcomes[p.item.custom_id] = Outcome.HALTED
    else:
        for p in asked:
            outcomes[p.item.custom_id] = p.job.fail(FAIL_BATCH_INVALID, f"the Batch API refused the batch: {refused}")
    records.close(ctx.redis, intent, [p.job.pid for p in asked], {"refused": str(refused)})
    log.error("%s batch %s refused: %s", dataset, intent.id, refused)
