"""The Celery app. ``celery -A workers worker -P gevent -c 1000 -Q specfleet.idle -E``.

Lives in ``workers/celery.py`` so ``-A workers`` finds it, and so importing ``workers.rebuild``
(tests, benchmarks) does not need a broker.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import setup_logging

from common import logs
from common.celeryconf import celery_config
from common.settings import Settings
from workers.events import BatchedTaskEvents
from workers.queues import FollowActiveQueues
from workers.recovery import ReplaySpool, RestoreUnacked

_settings = Settings.from_env()

app = Celery("specfleet", set_as_current=True, include=["workers.task"])
app.conf.update(celery_config(_settings, _settings.require_redis_url()))
app.steps["consumer"].add(FollowActiveQueues)
app.steps["consumer"].add(BatchedTaskEvents)
app.steps["consumer"].add(RestoreUnacked)
app.steps["consumer"].add(ReplaySpool)


@setup_logging.connect
def _logging(**_: Any) -> None:
    # Connecting here stops Celery from installing its own handlers: ours scrub the API key.
    logs.configure(_settings.log_level)
