"""A worker process's door to the fleet-wide throttle (``common/throttle.py``).

When the fleet is at its limit, a thousand greenlets asking Redis for a slot every few milliseconds
would cost more CPU than the requests they wait to send. So in each process one greenlet at a time
asks (the head); the others queue behind it on a local lock, in arrival order. A slot freed in this
process wakes the head at once; slots freed elsewhere are noticed within ``POLL_S``.

``Gate.slot`` wraps one upstream attempt: it acquires, and releases with the attempt's outcome read
from what the attempt returned or raised (``outcome_of``).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import gevent
import gevent.event
import gevent.lock

from common.config import ThrottleLimits
from common.errors import UpstreamError
from common.throttle import NO_CAPS, FleetThrottle, Outcome

log = logging.getLogger(__name__)

#: How often the head asks again while the fleet is at its limit and nothing here was freed.
POLL_S = 0.05
#: While queued this long, the waiting request's keepalive runs (the budget lease is renewed).
KEEPALIVE_EVERY_S = 5.0
#: "Too many requests" and "overloaded": the provider's capacity speaking, whoever said it.
THROTTLED_STATUSES = frozenset({429, 503})


def outcome_of(error: BaseException | None) -> tuple[Outcome, float | None]:
    """The throttle's reading of one attempt (None: it answered) and the Retry-After it carried.

    A 429/503, or a 200 whose error object has code 429/503 (openrouter.md), is the provider
    saying "too many"; a timeout, a 400 or a worker shutting down says nothing about capacity."""
    if error is None:
        return "ok", None
    if isinstance(error, UpstreamError) and (error.status in THROTTLED_STATUSES
                                             or error.code in THROTTLED_STATUSES):
        return "throttled", error.retry_after_s
    return "other", None


class Gate:
    def __init__(self, throttle: FleetThrottle) -> None:
        self._throttle = throttle
        self._head = gevent.lock.Semaphore(1)
        self._freed = gevent.event.Event()

    @contextmanager
    def slot(self, *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS,
             keepalive: Callable[[], None] | None = None) -> Iterator[None]:
        """One upstream attempt inside a fleet-wide slot, released with its outcome (an exception
        of the attempt passes through)."""
        slot = self.acquire(ttl_ms=ttl_ms, limits=limits, keepalive=keepalive)
        try:
            yield
        except BaseException as exc:
            outcome, retry_after_s = outcome_of(exc)
            self.release(slot, outcome, retry_after_s=retry_after_s, limits=limits)
            raise
        self.release(slot, "ok", limits=limits)

    def acquire(self, *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS,
                keepalive: Callable[[], None] | None = None) -> str:
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
                self._freed.clear()  # before asking: a slot freed while Redis answers still wakes us
                admission = self._throttle.acquire(slot, ttl_ms=ttl_ms, limits=limits)
                if admission.ok:
                    return slot
                if admission.why == "limit":
                    self._freed.wait(timeout=POLL_S * random.uniform(0.5, 1.5))
                else:  # a Retry-After pause or the rate bucket: the wait is known
                    gevent.sleep(admission.wait_ms / 1000)
                tick()
        finally:
            self._head.release()

    def release(self, slot: str, outcome: Outcome, *, retry_after_s: float | None = None,
                limits: ThrottleLimits = NO_CAPS) -> None:
        """Never raises (a paid answer must not be lost to a Redis blip): the slot expires by its TTL."""
        try:
            self._throttle.release(slot, outcome, retry_after_s=retry_after_s, limits=limits)
        except Exception as exc:
            log.warning("throttle release failed (%s: %s); the slot expires by itself", type(exc).__name__, exc)
        self._freed.set()
