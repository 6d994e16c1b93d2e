"""Celery's remote-control loop survives a broker failover (fenced: ``PATCHES``).

In a gevent worker, Celery runs the broadcast consumer (what ``celery inspect ping``, Flower and the
producer's ``specfleet_follow`` reach) as one greenlet, ``gPidbox.loop``, on a connection of its own:
it subscribes to the control fanout (Redis PUB/SUB) and drains it. Any error but a socket timeout
ends that greenlet, and nothing starts it again unless the main consumer restarts its whole
blueprint. After a Sentinel failover the subscription's connection to the dead master fails
(``ConnectionError … 127.0.0.1:7001``) while the task consumer rides the failover out on its own
(workers/runtime/kombu_redis.py, workers/fleet/writes.py): the worker kept working but answered no
ping and heard no broadcast again (issue 35: both workers, in one failover of two).

The replacement is Celery's loop inside a reconnect loop: on an error it logs one line, waits (1 s,
doubling to 10 s, cut short by the worker stopping), connects again in one attempt (through
Sentinel: to the new master) and subscribes again. The stop handshake (``_node_shutdown`` /
``_node_stopped``) is Celery's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from celery.worker import pidbox
from kombu.exceptions import OperationalError

from common.runtime import Patch, check

log = logging.getLogger(__name__)

#: The first wait before connecting again, and the longest (doubling between).
RECONNECT_FIRST_S = 1.0
RECONNECT_MAX_S = 10.0


def _loop(self: Any, c: Any) -> None:
    resets = [self._resets]
    shutdown = self._node_shutdown = threading.Event()
    stopped = self._node_stopped = threading.Event()
    broker_errors = (OperationalError, *c.connection_errors, *c.channel_errors)
    wait_s = RECONNECT_FIRST_S
    try:
        while not shutdown.is_set() and c.connection:
            try:
                with c.app.connection_for_read() as connection:
                    # One attempt (Celery's c.connection_for_read retries 2, 4, 6… s): this loop waits and
                    # tries again itself, and a consumer restarting meanwhile does not wait out a ladder
                    # to stop this step.
                    connection.ensure_connection(max_retries=0)
                    log.info("pidbox: Connected to %s.", connection.as_uri())
                    self._do_reset(c, connection)
                    wait_s = RECONNECT_FIRST_S  # subscribed again: the next loss starts from the first wait
                    while not shutdown.is_set() and c.connection:
                        if resets[0] < self._resets:
                            resets[0] += 1
                            self._do_reset(c, connection)
                        with contextlib.suppress(TimeoutError):  # socket.timeout: nothing came
                            connection.drain_events(timeout=1.0)
            except Exception as exc:  # Celery's loop ended here for good: this one connects again
                if shutdown.is_set() or not c.connection:
                    return
                log.warning("remote control lost the broker (%s: %s); subscribing again in %.0f s",
                            type(exc).__name__, exc, wait_s, exc_info=not isinstance(exc, broker_errors))
                shutdown.wait(wait_s)
                wait_s = min(2 * wait_s, RECONNECT_MAX_S)
    finally:
        stopped.set()


PATCHES = (
    Patch(target="celery.worker.pidbox:gPidbox.loop", dist="celery", verified="5.7.0",
          fingerprint="3cb6124f30c616ff71c5120432c08e96846482a10398653a014ecb49ec895ffe",
          why="the remote-control loop reconnects after a broker failover",
          reason="gPidbox.loop catches only socket.timeout around drain_events: a ConnectionError from the "
                 "control subscription's dead master ended the greenlet, and the worker answered no ping or "
                 "broadcast again unless its main consumer happened to restart (issue 35). The replacement "
                 "runs the same loop inside a reconnect loop with one warning line per loss.",
          upstream="none filed", replacement="workers.runtime.celery_pidbox:_loop"),
)


def install() -> None:
    check(PATCHES)
    pidbox.gPidbox.loop = _loop


__all__ = ["PATCHES", "RECONNECT_FIRST_S", "RECONNECT_MAX_S", "install"]
