"""The one Celery task. Thin on purpose: the work is in ``workers/generate.py``."""

from __future__ import annotations

from celery import Task

from common.contract import TASK_NAME, TaskPayload
from workers.celery import app
from workers.context import context
from workers.generate import Busy, generate


# acks_late comes from common/celeryconf.py (task_acks_late): one place says it, and tests flip it there.
@app.task(name=TASK_NAME, bind=True, max_retries=None, ignore_result=True)
def generate_task(self: Task, payload: TaskPayload) -> str:
    outcome = generate(context(), payload)
    if isinstance(outcome, Busy):
        # Another delivery of this prompt is live (a visibility-timeout redelivery of a slow
        # task): come back after its lease, short of the visibility timeout so the ETA never loops.
        raise self.retry(countdown=outcome.wait_s)
    return outcome


__all__ = ["generate_task"]
