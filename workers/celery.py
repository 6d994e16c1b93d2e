"""The Celery app. ``celery -A workers worker -P gevent -c 1000 -Q specfleet.idle -E``.

Lives in ``workers/celery.py`` so ``-A workers`` finds it, and so importing ``workers.pipeline.generate``
(tests, benchmarks) does not need a broker.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import setup_logging, worker_ready, worker_shutting_down

from common import logs
from common.celeryconf import celery_config
from common.errors import PatchDrift
from common.settings import Settings
from workers import runtime
from workers.batch.poll import PollBatches
from workers.fleet import poison, stop, writes
from workers.fleet.context import context
from workers.fleet.events import BatchedTaskEvents
from workers.fleet.heap import settle_long_lived
from workers.fleet.queues import FollowActiveQueues
from workers.fleet.recovery import ReplaySpool, RestoreUnacked
from workers.fleet.send_room import start as start_send_room

_settings = Settings.from_env()


def _admit(raw: bytes, queue: str, unacked: tuple[str, str] | None = None) -> dict[str, Any] | None:
    return poison.admit(context().redis, raw, queue, unacked=unacked)


try:
    # Every patch of another library's private code, checked against the versions verified before
    # any is applied, here: after -P gevent patched the standard library, before Celery consumes.
    runtime.install(start_send_room(_settings.worker_concurrency), admit=_admit)
except PatchDrift as exc:
    runtime.refuse(exc)
writes.install(lambda: context().redis)

app = Celery("specfleet", set_as_current=True, include=["workers.pipeline.task"])
app.conf.update(celery_config(_settings, _settings.require_redis_url()))
app.conf.worker_consumer = "workers.fleet.consumer:Consumer"  # binds its queues only once Redis takes writes
app.steps["consumer"].add(FollowActiveQueues)
app.steps["consumer"].add(BatchedTaskEvents)
app.steps["consumer"].add(RestoreUnacked)
app.steps["consumer"].add(ReplaySpool)
app.steps["consumer"].add(PollBatches)


@setup_logging.connect
def _logging(**_: Any) -> None:
    # Connecting here stops Celery from installing its own handlers: ours scrub the API key.
    logs.configure(_settings.log_level)
    if logging.getLogger().getEffectiveLevel() >= logging.INFO:
        # Celery's "Task … received" and "Task … succeeded in …" lines say again what the task's
        # own step lines (prepare … settle) say, a third of the log volume and its cost per row.
        # Failures still reach the log (ERROR); Flower still shows every task's received/started/
        # succeeded. With SPECFLEET_LOG_LEVEL=DEBUG they are back.
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)


@worker_ready.connect
def _heap(**_: Any) -> None:
    settle_long_lived("worker ready")


@worker_shutting_down.connect
def _stop(**_: Any) -> None:
    stop.begin()  # the shutdown ends within workers/fleet/stop.py's bound, whatever Redis does
