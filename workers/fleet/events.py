"""Task events in batches: what Flower shows, at a fraction of the cost.

Celery sends three task events per task (received, started, succeeded), each its own PUBLISH. Its
event dispatcher can buffer the ``task`` group and publish a batch as one ``task.multi`` message
(Flower's and every ``EventReceiver`` read those lists), but the worker turns that on only for the
prefork pool's event loop, not for gevent. At 300 ms upstream latency a profile of a gevent worker
showed 22% of its main thread in ``EventDispatcher.send``; batched, the events cost a few percent.

What a Flower user sees: every task and its outcome (received, started, succeeded/failed, runtime)
and every worker, exactly as before, up to ``FLUSH_EVERY_S`` later. Worker events (online,
heartbeat, offline) are not buffered.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

log = logging.getLogger(__name__)

#: Longest a task event waits in the buffer: Flower's views lag by at most this much.
FLUSH_EVERY_S = 0.5
#: Events per published batch at most; a busy worker publishes a batch as soon as it is full.
BATCH_MAX_EVENTS = 200


class BatchedTaskEvents(bootsteps.StartStopStep):
    """Turns on Celery's own task-event buffering for the gevent pool, with a timer to flush it."""

    requires = {"celery.worker.consumer.events:Events"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None

    def start(self, c: Any) -> None:
        dispatcher = c.event_dispatcher
        if dispatcher is None or not dispatcher.enabled or c.hub is not None:
            return  # events off (no -E), or the prefork event loop, which buffers by itself
        dispatcher.buffer_group = frozenset({"task"})
        dispatcher.buffer_limit = BATCH_MAX_EVENTS
        self._timer = c.timer.call_repeatedly(FLUSH_EVERY_S, self._flush, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._flush(c)  # before the Events step closes the dispatcher, which drops the buffer

    shutdown = stop

    @staticmethod
    def _flush(c: Any) -> None:
        dispatcher = c.event_dispatcher
        if dispatcher is None:
            return
        try:
            dispatcher.flush(errors=True, groups=True)
        except Exception as exc:  # a broker blip: the batch stays buffered for the next flush
            log.warning("cannot publish task events: %s", exc)
