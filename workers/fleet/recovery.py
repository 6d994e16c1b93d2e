"""Consumer bootsteps that bring work back after a crash: unacked messages and spooled outcomes.

``RestoreUnacked``: with ``task_acks_late`` a message stays in kombu's ``unacked`` hash until its
task ends; kombu's Redis transport puts messages older than the visibility timeout back in their
queue (``QoS.restore_visible``), but with gevent workers (no event loop) it does so only after a
poll comes back empty, so a SIGKILLed worker's tasks waited for the whole queue to drain
(celery/celery#4968, #4976; celery/kombu#1025, #1098). Here every worker calls it on a timer,
every ``SPECFLEET_UNACKED_RESTORE_S``; kombu's ``unacked_mutex`` makes one worker at a time do it.
A dead worker's tasks are back in their queue within visibility_timeout_s + unacked_restore_s.

``ReplaySpool``: answers a worker could not settle while Redis was away (workers/fleet/spool.py) are
replayed before the worker consumes anything, then every few seconds.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from common.redis_client import REFUSED_WRITES
from workers.fleet import spool, writes
from workers.fleet import stop as worker_stop
from workers.fleet.context import context

log = logging.getLogger(__name__)

SPOOL_REPLAY_S = 2.0


class RestoreUnacked(bootsteps.StartStopStep):
    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None

    def start(self, c: Any) -> None:
        worker_stop.consumer(c)  # its unacked messages go back if a stop reaches its bound
        self._timer = c.timer.call_repeatedly(context().settings.unacked_restore_s, self.restore, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def restore(self, c: Any) -> None:
        consumer = getattr(c, "task_consumer", None)
        channel = getattr(consumer, "channel", None)
        qos = getattr(channel, "qos", None)
        if qos is None or not hasattr(qos, "restore_visible") or writes.refusing():
            return
        try:
            # interval=1: kombu's throttle (scan on every 10th call) is for its own per-poll calls.
            qos.restore_visible(num=None, interval=1)
        except REFUSED_WRITES as exc:  # said once by the state; the first tick after it restores
            writes.refused(exc)
        except Exception as exc:  # Redis away or the consumer restarting: the next tick retries
            log.warning("cannot restore unacked messages: %s", exc)


class ReplaySpool(bootsteps.StartStopStep):
    # Before the task consumer starts (and FollowActiveQueues with it): a spooled row must be kept
    # before any delivery of its prompt can be taken for a prompt without an outcome.
    requires = {"celery.worker.consumer.connection:Connection"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None

    def start(self, c: Any) -> None:
        self.replay()
        self._timer = c.timer.call_repeatedly(SPOOL_REPLAY_S, self.replay, (), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def replay(self) -> None:
        ctx = context()
        if writes.refusing() or not spool.pending(ctx.settings.spool_dir):
            return
        try:
            n = spool.replay(ctx.redis, ctx.settings.spool_dir)
        except REFUSED_WRITES as exc:  # the entry stays; the first tick after writes are back replays it
            writes.refused(exc)
            return
        except Exception:  # a timer that raises is never called again
            log.exception("spool replay failed")
            return
        if n:
            log.warning("replayed %d spooled outcome(s) from %s", n, ctx.settings.spool_dir)
