"""The producer's own Celery app: same settings as the workers', no tasks imported.

Used to build task messages in the exact format workers expect and for control broadcasts.
"""

from __future__ import annotations

from celery import Celery

from common.celeryconf import celery_config
from common.settings import Settings


def make_app(settings: Settings, redis_url: str) -> Celery:
    app = Celery("specfleet-producer", set_as_current=False)
    app.conf.update(celery_config(settings, redis_url))
    return app
