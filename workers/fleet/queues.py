"""A consumer bootstep that makes every worker follow the active dataset queues by itself.

``add_consumer``/``cancel_consumer`` broadcasts are lost when a worker restarts or a replica starts
later, so instead each worker polls ``keys.ACTIVE_QUEUES`` (queue -> run-config id) and adjusts
its own consumers (the ``specfleet.q.*`` ones only: other queues the worker was given are left
alone). Before consuming a run's queue it loads and checks that run's tokenizer, so a
broken tokenizer stops the worker before it sends a single paid request.

The poll (2 s by default) would make every dataset start wait a second on average before its first
request, so the producer also broadcasts ``FOLLOW_COMMAND`` when the active queues change, and
a worker that hears it reads them at once; one that misses it (restarting, on a lost connection)
still has its poll.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import redis
from celery import bootsteps
from celery.worker.control import control_command

from common import keys
from common.contract import FOLLOW_COMMAND
from common.errors import SpecfleetError
from common.hf import auto_tokenizer
from common.redis_client import REFUSED_WRITES
from workers.fleet import server, writes
from workers.fleet.context import context

log = logging.getLogger(__name__)


def _next_poll(channel: Any, client: redis.Redis) -> bool:
    return False  # unpatched kombu: the queue is read when the running BRPOP next returns


#: Ends a consumer's running BRPOP so it starts over with the queue just added. It reads kombu's
#: private poller, so the kombu patch hands it over (``on_follow``, from workers/runtime/kombu_redis.py's
#: ``install``) rather than this module reaching up into the patches.
_wake_consumer: Callable[[Any, redis.Redis], bool] = _next_poll


def on_follow(wake: Callable[[Any, redis.Redis], bool]) -> None:
    """Install how a followed queue reaches a consumer blocked in BRPOP now (the kombu patch's)."""
    global _wake_consumer
    _wake_consumer = wake


#: Queue -> the run-config id it serves, as this worker last read ``keys.ACTIVE_QUEUES``: the run a
#: task of that queue must name (workers/fleet/poison.py asks Redis again before refusing one).
_serving: dict[str, str] = {}


def serving(queue: str) -> str | None:
    return _serving.get(queue)


#: Runs this worker refused: it is leaving, and follows none of their queues meanwhile.
_refused: set[str] = set()


def refuse_run(config_id: str, exc: Exception) -> None:
    """This worker cannot make the run's rows (a tokenizer that is not the manifest's, a setting
    missing here): it leaves, saying why in one line; what it holds goes back for another worker."""
    if config_id in _refused:
        return
    _refused.add(config_id)
    log.critical("refusing run %s, shutting this worker down: %s", config_id, exc)
    os.kill(os.getpid(), signal.SIGTERM)


class FollowActiveQueues(bootsteps.StartStopStep):
    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._timer: Any = None
        self._syncing = False

    def start(self, c: Any) -> None:
        # Importing transformers takes a second or two: pay it when the worker starts, not when the
        # first run arrives and 1,000 greenlets wait for its tokenizer.
        auto_tokenizer()
        c.specfleet_follow = self  # for the producer's broadcast (follow_now below)
        self.sync(c)
        self._timer = c.timer.call_repeatedly(context().settings.queue_poll_s, self.sync, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def sync(self, c: Any) -> None:
        if self._syncing:  # the poll and a broadcast at once: one reading is enough
            return
        self._syncing = True
        try:
            self._sync(c)
        finally:
            self._syncing = False

    def _sync(self, c: Any) -> None:
        if getattr(c, "connection", None) is None:  # the consumer is reconnecting: its start syncs
            return
        ctx = context()
        try:
            pipe = ctx.redis.pipeline(transaction=False)
            store, raw = pipe.get(keys.STORE_ID).hgetall(keys.ACTIVE_QUEUES).execute()
            if not server.check(ctx.redis, ctx.settings.require_redis_url(), store, raw):
                return  # another Redis: this worker follows none of its queues, it is leaving
        except Exception as exc:  # a Redis blip must not kill the timer; next tick retries
            log.warning("cannot read active queues: %s", exc)
            return
        active = {k.decode(): v.decode() for k, v in raw.items()}
        _serving.clear()
        _serving.update(active)
        consuming = {q.name for q in c.task_consumer.queues}
        for queue, config_id in sorted(active.items()):
            if config_id in _refused:
                continue
            try:
                # A queue followed already may serve a new run (the same dataset name): checked too.
                ctx.prepare(config_id)
            except SpecfleetError as exc:
                refuse_run(config_id, exc)
                return
            if queue in consuming:
                continue
            try:
                c.add_task_queue(queue)
            except REFUSED_WRITES as exc:
                # kombu binds the queue with a write (SADD _kombu.binding.<queue>): Redis refusing
                # writes is a state (workers/fleet/writes.py), and the next poll follows the queue.
                writes.refused(exc)
                return
            server.serving(config_id)
            woken = _wake_consumer(c.task_consumer.channel, ctx.redis)
            log.info("following %s (run %s)%s", queue, config_id, "" if woken else ", from the next poll")
        # Only dataset queues a run has left: a queue the user added (``-Q other``, an
        # ``add_consumer`` broadcast) is theirs, not ours to undo.
        for queue in sorted(q for q in consuming - active.keys() if q.startswith(keys.QUEUE_PREFIX)):
            c.cancel_task_queue(queue)
            log.info("left %s", queue)


@control_command(name=FOLLOW_COMMAND)
def follow_now(state: Any) -> dict[str, str]:
    """The producer changed the active queues: follow them now, not at the next poll."""
    step = getattr(state.consumer, "specfleet_follow", None)
    if step is not None:
        step.sync(state.consumer)
    return {"ok": "synced"}
