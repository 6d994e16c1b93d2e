"""A worker process's start, in one place and in order: ``boot``.

``celery -A workers worker`` (which ``specfleet worker`` exec's) imports workers/celery.py, which
only defines the app: importing it reads no setting and patches nothing. The app's ``Settings``
are read from the environment once per process, when Celery first reads the app's conf (the
worker's command line does, after ``-P gevent`` patched the standard library). Celery's
``celeryd_init`` signal, sent before the worker builds its consumer, then calls ``boot`` with those
same settings, which builds the process's one ``WorkerContext`` and hands it (and the settings) to
everything that needs them:

1. the context, made the process's (workers/fleet/context.py): the task and the consumer's steps;
2. the patches of other libraries (workers/runtime/), checked before any is applied: a drifted one
   ends the process with its one line and exit code (``runtime.refuse``), before Celery consumes;
   kombu's read hands each message to poison.py's ``admit`` with the context's Redis and scrubber;
3. the write probe's client (workers/fleet/writes.py);
4. logging, when Celery asks for it: our handler, scrubbing the settings' API keys;
5. the heap settling at ready, the bounded stop at shutdown (workers/fleet/heap.py, stop.py);
6. the task's shared result-backend object.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from celery import Celery
from celery.signals import setup_logging, worker_ready, worker_shutting_down

from common import logs
from common.contract import TASK_NAME
from common.errors import PatchDrift
from common.settings import Settings
from workers import runtime
from workers.fleet import context, poison, stop, writes
from workers.fleet.context import WorkerContext
from workers.fleet.heap import settle_long_lived
from workers.fleet.send_room import start as start_send_room


def boot(settings: Settings, app: Celery) -> WorkerContext:
    """Set this worker process up on ``settings`` (see the module's list); once per process."""
    ctx = WorkerContext(settings)
    context.install(ctx)
    try:
        runtime.install(start_send_room(settings.worker_concurrency),
                        admit=partial(_admit, ctx))
    except PatchDrift as exc:
        runtime.refuse(exc)
    writes.install(lambda: ctx.redis)
    # weak=False: the receiver is a partial nothing else holds.
    setup_logging.connect(partial(_logging, settings), weak=False)
    worker_ready.connect(_heap)
    worker_shutting_down.connect(_stop)
    # Celery looks the result backend up per task through a thread-local, which gevent makes
    # greenlet-local: without this, every task (a new greenlet) builds a backend object of its own
    # (4% of a busy worker). There is no result backend (common/celeryconf.py): one shared object.
    app.tasks[TASK_NAME].backend = app.backend
    return ctx


def _admit(ctx: WorkerContext, raw: bytes, queue: str,
           unacked: tuple[str, str] | None = None) -> dict[str, Any] | None:
    return poison.admit(ctx.redis, raw, queue, scrub=ctx.scrub, unacked=unacked)


def _logging(settings: Settings, **_: Any) -> None:
    # Connecting here stops Celery from installing its own handlers: ours scrub the API key.
    logs.configure(settings.log_level, settings.secrets)
    if logging.getLogger().getEffectiveLevel() >= logging.INFO:
        # Celery's "Task … received" and "Task … succeeded in …" lines say again what the task's
        # own step lines (prepare … settle) say, a third of the log volume and its cost per row.
        # Failures still reach the log (ERROR); Flower still shows every task's received/started/
        # succeeded. With SPECFLEET_LOG_LEVEL=DEBUG they are back.
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _heap(**_: Any) -> None:
    settle_long_lived("worker ready")


def _stop(**_: Any) -> None:
    stop.begin()  # the shutdown ends within workers/fleet/stop.py's bound, whatever Redis does
