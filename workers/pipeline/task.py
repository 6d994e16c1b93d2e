"""The one Celery task. Thin on purpose: it picks the dataset's mode from ``MODES`` and the mode does
the work, composing the steps of ``workers/pipeline/job.py``: one prompt (``generate.py``), every turn
of a conversation (``conversation.py``, ``regenerate = "all"``) or batch mode (``batch/submit.py``).

Declared with ``shared_task``, not on the app: the app (workers/celery.py) includes this module and
sits above it, so nothing in workers/pipeline/ imports the app that imports workers/pipeline/."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection
from typing import Any

import gevent
from celery import Task, shared_task
from celery.exceptions import Reject

from common.config import WorkerView
from common.contract import CONTRACT_VERSION, TASK_NAME, TaskPayload
from common.errors import ConfigError, SpecfleetError
from common.outcomes import Outcome
from common.redis_client import REFUSED_WRITES
from workers.fleet import poison, server, writes
from workers.fleet.context import WorkerContext, context
from workers.fleet.queues import refuse_run, serving
from workers.fleet.send_room import SendRoom, process_room
from workers.pipeline.batch.submit import submit
from workers.pipeline.conversation import generate_conversation
from workers.pipeline.generate import generate
from workers.pipeline.job import Busy, Mode

#: How long a refused message waits, unacked, for Redis to take its dead-letter entry.
DEAD_LETTER_WAIT_S = 30.0


# acks_late comes from common/celeryconf.py (task_acks_late): one place says it, and tests flip it there.
@shared_task(name=TASK_NAME, bind=True, max_retries=None, ignore_result=True)
def generate_task(self: Task, payload: TaskPayload) -> str:
    """The prompt's ``Outcome`` as its plain word: what Celery logs and Flower shows."""
    room = process_room()
    with room.task(self.request.id):
        ctx = context()
        if server.left():  # another Redis than the one this worker served: its tasks are not ours
            raise Reject("this worker is leaving a Redis it did not serve", requeue=True)
        if _refused(ctx, payload, self.request.delivery_info):
            return str(Outcome.DEAD_LETTER)
        try:
            ctx.tokenizer(ctx.run(payload["run"]))  # loaded and checked once per run; then a lookup
        except SpecfleetError as exc:  # not the manifest's tokenizer here: the message is another worker's
            refuse_run(payload["run"], exc)
            raise Reject(f"run {payload['run']}: {exc}", requeue=True) from None
        outcome = _handle(ctx, payload, room)
        while isinstance(outcome, Busy):
            # Another delivery of this prompt holds a live lease (a copy kombu put back when a
            # Redis restart closed a channel, or a visibility-timeout redelivery of a slow task).
            # Wait it out here, keeping this message unacked: a Celery retry would go to the back
            # of the queue, and if the holder then died its prompt would wait for the whole queue
            # instead of the visibility timeout. A greenlet costs nothing to park.
            with room.parked():
                gevent.sleep(outcome.wait_s)
            outcome = _handle(context(), payload, room)
    return str(outcome)


#: The mode table: (whether a dataset of the run is worked so, the mode), the first that holds;
#: single mode (``generate``, one prompt live) for every other dataset.
MODES: tuple[tuple[Callable[[WorkerView, str], bool], Mode], ...] = (
    (WorkerView.regenerates_all, generate_conversation),  # regenerate = "all": every assistant turn
    (WorkerView.batched, submit),  # [request] batch: through the Batch API at its price
)


def handle(ctx: WorkerContext, payload: TaskPayload) -> Outcome | Busy:
    """The task body: the payload through its dataset's mode (``MODES``)."""
    mode: Mode = generate
    if payload.get("v") == CONTRACT_VERSION:  # another version: single mode refuses it, one line
        view = ctx.run(payload["run"])
        mode = next((m for holds, m in MODES if holds(view, payload["dataset"])), generate)
    return mode(ctx, payload)


def _handle(ctx: WorkerContext, payload: TaskPayload, room: SendRoom) -> Outcome | Busy:
    while True:
        try:
            return handle(ctx, payload)
        except REFUSED_WRITES as exc:
            # Met before the request (reserve, renew, the throttle's slot: a paid answer's settle
            # spools instead), so nothing was asked: wait for writes and start over, unacked.
            writes.refused(exc)
            with room.parked():
                writes.wait()


def _refused(ctx: WorkerContext, payload: TaskPayload, delivery_info: dict[str, Any] | None) -> bool:
    """Whether the payload is not one of ours (workers/fleet/poison.py): then it is dead-lettered here.
    The transport checked its envelope and shape already; this needs Redis (run, dataset, id)."""
    queue = (delivery_info or {}).get("routing_key")
    refusal = poison.check_task(ctx.redis, dict(payload), queue, serving(queue) if queue else None,
                                lambda run: _datasets(ctx, run))
    if refusal is None:
        return False
    raw = json.dumps(payload, ensure_ascii=False, default=str).encode()
    # Unacked until recorded: a Redis that cannot take the entry now may in a moment.
    give_up = time.monotonic() + DEAD_LETTER_WAIT_S
    while not poison.dead_letter(ctx.redis, raw, queue or "", refusal, scrub=ctx.scrub) and time.monotonic() < give_up:
        gevent.sleep(1.0)
    return True


def _datasets(ctx: WorkerContext, run: str) -> Collection[str] | None:
    try:
        return ctx.run(run).datasets.keys()
    except ConfigError:  # no such run in this Redis
        return None


__all__ = ["generate_task"]
