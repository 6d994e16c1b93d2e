"""The one Celery task. Thin on purpose: the work is in ``workers/generate.py`` (one prompt) and
``workers/conversation.py`` (every turn of a conversation, ``regenerate = "all"``)."""

from __future__ import annotations

import gevent
from celery import Task

from common.contract import TASK_NAME, TaskPayload
from workers.celery import app
from workers.context import context
from workers.conversation import handle
from workers.generate import Busy
from workers.send_room import process_room


# acks_late comes from common/celeryconf.py (task_acks_late): one place says it, and tests flip it there.
@app.task(name=TASK_NAME, bind=True, max_retries=None, ignore_result=True)
def generate_task(self: Task, payload: TaskPayload) -> str:
    room = process_room()
    with room.task(self.request.id):
        outcome = handle(context(), payload)
        while isinstance(outcome, Busy):
            # Another delivery of this prompt holds a live lease (a copy kombu put back when a
            # Redis restart closed a channel, or a visibility-timeout redelivery of a slow task).
            # Wait it out here, keeping this message unacked: a Celery retry would go to the back
            # of the queue, and if the holder then died its prompt would wait for the whole queue
            # instead of the visibility timeout. A greenlet costs nothing to park.
            with room.parked():
                gevent.sleep(outcome.wait_s)
            outcome = handle(context(), payload)
    return outcome


# Celery looks the result backend up per task through a thread-local, which gevent makes
# greenlet-local: without this, every task (a new greenlet) builds a backend object of its own
# (4% of a busy worker). There is no result backend (common/celeryconf.py): one shared object.
generate_task.backend = app.backend


__all__ = ["generate_task"]
