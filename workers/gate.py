"""A worker process's door to the fleet-wide throttle (``common/throttle.py``).

When the fleet is at its limit, a thousand greenlets asking Redis for a slot every few milliseconds
would cost more CPU than the requests they wait to send. So in each process one greenlet at a time
asks (the head); the others queue behind it on a local lock, in arrival order. A slot freed in this
process wakes the head at once; slots freed elsewhere are noticed within ``POLL_S``.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable

import gevent
import gevent.event
import gevent.lock
import redis

from common.throttle import FleetThrottle, Outcome

log = logging.getLogger(__name__)

#: How often the head asks again while the fleet is at its limit and nothing here was freed.
POLL_S = 0.05
#: While queued this long, the waiting request's keepalive runs (the budget lease is renewed).
KEEPALIVE_EVERY_S = 5.0


class Gate:
    def __init__(self, throttle: FleetThrottle) -> None:
        self._throttle = throttle
        self._head = gevent.lock.Semaphore(1)
        self._freed = gevent.event.Event()

    def acquire(self, *, ttl_ms: int, keepalive: Callable[[], None] | None = None) -> str:
        """Wait for a fleet-wide slot; returns its id. ``keepalive`` runs every KEEPALIVE_EVERY_S of
        waiting and may raise to give up (the dataset was stopped meanwhile)."""
        slot = uuid.uuid4().hex
        last_keepalive = time.monotonic()

        def tick() -> None:
            nonlocal last_keepalive
            if keepalive is not None and time.monotonic() - last_keepalive >= KEEPALIVE_EVERY_S:
                last_keepalive = time.monotonic()
                keepalive()

        while not self._head.acquire(timeout=KEEPALIVE_EVERY_S):
            tick()
        try:
            while True:
                admission = self._throttle.acquire(slot, ttl_ms=ttl_ms)
                if admission.ok:
                    return slot
                if admission.why == "limit":
                    self._freed.clear()
                    self._freed.wait(timeout=POLL_S * random.uniform(0.5, 1.5))
                else:  # a Retry-After pause or the rate bucket: the wait is known
                    gevent.sleep(admission.wait_ms / 1000)
                tick()
        finally:
            self._head.release()

    def release(self, slot: str, outcome: Outcome, *, retry_after_s: float | None = None) -> None:
        try:
            self._throttle.release(slot, outcome, retry_after_s=retry_after_s)
        except redis.RedisError as exc:  # the slot expires on its own; the answer matters more
            log.warning("throttle release failed (%s); the slot expires by itself", exc)
        self._freed.set()
