"""SIGTERM ends a worker within ``STOP_BOUND_S``, whatever Redis does.

Celery's warm shutdown waits for every task of the pool, and with Redis gone ours wait for it:
a task in its reserve retries for ``SPECFLEET_REDIS_RETRY_WINDOW_S`` (300 s), the consumer loops on
its reconnect, and Celery's heartbeat retries its publish for ever. Workers SIGTERMed 8 s after
Redis went away were alive 8-20 minutes later, and a leftover later worked the next run's prompts
on a new Redis at the same address. So, from the SIGTERM (Celery's ``worker_shutting_down``):

- the warm shutdown goes on as before (tasks in flight finish; with Redis up kombu puts the
  messages it holds back in their queues), except that a paid answer whose settle meets an
  unreachable Redis is spooled at once instead of waiting out its lease (workers/fleet/spool.py);
- once Redis is unreachable during the stop (at the SIGTERM or later), every outcome goes to the
  spool at once, those being written included (``spool.spill``): a settle begun before the stop
  would otherwise wait its lease, or a free connection, past the bound (soak: 16-34 paid answers
  left per stopped worker, asked again elsewhere). Requests still open upstream may finish until
  the bound, each answer spooled as it lands; once none is open and every answer is on disk, the
  worker exits at once (status 0) instead of at the bound;
- at ``STOP_BOUND_S`` whatever is still running is left: settles not yet on disk get up to
  ``WRITES_GRACE_S`` more, kombu is asked to put the worker's unacked messages back (only when
  Redis answers: otherwise they come back by the visibility timeout, and the done set answers any
  whose prompt was kept), one line says what was left, and the process exits (status 0). An upstream
  request still open then is abandoned: its prompt is asked again by its next delivery.

A real thread exits the process ``BACKSTOP_S`` after the bound should the hub itself be stuck.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import gevent
import gevent.monkey

from common.redis_client import CLOCK, deadline
from workers.fleet import spool
from workers.fleet.send_room import process_room

log = logging.getLogger(__name__)

#: Seconds from SIGTERM to the worker's exit at most (``WRITES_GRACE_S`` more for spool writes).
STOP_BOUND_S = 30.0
WRITES_GRACE_S = 5.0
#: How long a settle waits for an unreachable Redis once the worker is stopping, before it spools.
HURRY_S = 1.0
BACKSTOP_S = 15.0
#: How often a stop with Redis away looks whether anything is left in flight.
WATCH_S = 0.1

_since: float | None = None
_consumer: Any = None


def consumer(c: Any) -> None:
    """The Celery consumer whose unacked messages go back at the bound (a bootstep's start)."""
    global _consumer
    _consumer = c


def begin() -> None:
    """SIGTERM (or SIGINT) arrived: the bound starts."""
    global _since
    if _since is not None:
        return
    _since = time.monotonic()
    spool.hurry(HURRY_S)
    gevent.spawn(_while_away)
    gevent.spawn(_at_bound)
    _backstop()


def _while_away() -> None:
    """Once Redis is unreachable: spill, and exit as soon as nothing paid is left in memory."""
    assert _since is not None
    spilled: int | None = None
    while True:
        gevent.sleep(WATCH_S)
        if CLOCK.down_since is None:
            continue
        if spilled is None:
            spilled = spool.spill("stopping while Redis is unreachable")
        if process_room().in_flight() == 0 and spool.unspooled() == 0:
            break
    log.warning("stopping %.1f s after SIGTERM (Redis unreachable): no upstream request in flight and every paid "
                "answer is spooled (%d being settled at the outage's start): exiting; their messages come back by "
                "the visibility timeout", time.monotonic() - _since, spilled)
    _exit(0)


def _at_bound() -> None:
    assert _since is not None
    gevent.sleep(STOP_BOUND_S)
    grace_end = time.monotonic() + WRITES_GRACE_S
    while spool.unspooled() and time.monotonic() < grace_end:
        gevent.sleep(0.1)
    returned = _return_unacked()
    log.warning("stopping %.0f s after SIGTERM with tasks still running (Redis %s): %s; %d settle(s) not yet "
                "spooled, and %d task(s) waiting for a throttle slot or an upstream answer, are left (their prompts "
                "are asked again)",
                time.monotonic() - _since, "unreachable" if CLOCK.down_since is not None else "up", returned,
                spool.unspooled(), process_room().requests_open)
    _exit(0)


def _return_unacked() -> str:
    channel = getattr(getattr(_consumer, "task_consumer", None), "channel", None)
    qos = getattr(channel, "qos", None)
    if qos is None or CLOCK.down_since is not None:
        return "their messages come back by the visibility timeout"
    try:
        with deadline(2.0):
            qos.restore_unacked()
    except Exception as exc:  # Redis went meanwhile: the visibility timeout brings them back
        return f"their messages come back by the visibility timeout ({type(exc).__name__})"
    return "their messages are back in their queues"


def _exit(code: int) -> None:
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(code)


def _backstop() -> None:
    start = gevent.monkey.get_original("_thread", "start_new_thread")
    sleep = gevent.monkey.get_original("time", "sleep")

    def run() -> None:
        sleep(STOP_BOUND_S + WRITES_GRACE_S + BACKSTOP_S)
        os.write(2, b"specfleet worker: the stop bound passed and the process did not exit: exiting now\n")
        os._exit(1)

    start(run, ())
