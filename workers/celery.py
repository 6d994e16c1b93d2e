"""The Celery app. ``celery -A workers worker -P gevent -c 1000 -Q specfleet.idle -E``.

Lives in ``workers/celery.py`` so ``-A workers`` finds it, and so importing ``workers.pipeline.generate``
(tests, benchmarks) does not need a broker. Importing it changes nothing: no setting is read and no
patch installed. The conf is read lazily (``WorkerApp.settings``, the first time Celery reads it:
the worker's command line, a healthcheck's ``inspect``, Flower); a worker process then starts in
workers/bootstrap.py's ``boot``, from Celery's ``celeryd_init`` signal.
"""

from __future__ import annotations

import sys
from functools import cached_property
from typing import Any

from celery import Celery
from celery.signals import celeryd_init

from common.celeryconf import celery_config
from common.errors import ConfigError
from common.settings import Settings
from workers import bootstrap
from workers.fleet.events import BatchedTaskEvents
from workers.fleet.queues import FollowActiveQueues
from workers.fleet.recovery import ReplaySpool, RestoreUnacked
from workers.pipeline.batch.poll import PollBatches


class WorkerApp(Celery):
    @cached_property
    def settings(self) -> Settings:
        """This process's settings: read from the environment here, once, when first asked."""
        return Settings.from_env()


def _conf(app: WorkerApp) -> dict[str, Any]:
    try:
        settings = app.settings
        url = settings.require_redis_url()
    except ConfigError as exc:  # met inside Celery's command line: one line, not its traceback
        sys.stderr.write(f"specfleet: {exc}\n")
        raise SystemExit(exc.exit_code) from None
    return {**celery_config(settings, url),
            "worker_consumer": "workers.fleet.consumer:Consumer"}  # binds its queues only once Redis takes writes


app = WorkerApp("specfleet", set_as_current=True, include=["workers.pipeline.task"])
app.add_defaults(lambda: _conf(app))  # called when the conf is first read, not here
app.steps["consumer"].add(FollowActiveQueues)
app.steps["consumer"].add(BatchedTaskEvents)
app.steps["consumer"].add(RestoreUnacked)
app.steps["consumer"].add(ReplaySpool)
app.steps["consumer"].add(PollBatches)


@celeryd_init.connect
def _boot(**_: Any) -> None:
    # Sent once, when the worker is built: after its command line read the conf (and with it the
    # settings), before its consumer exists.
    bootstrap.boot(app.settings, app)
