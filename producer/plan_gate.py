"""The plan gate: no request of a run starts until its plan clears it. One object, the runner's.

The plan's counts (``producer/plan.PendingPlan``) run beside the run's start. Until they clear the
run, the fleet-wide throttle holds every request (``FleetThrottle.reset(hold=True)``: workers take
and prepare prompts, and wait there before their request); the gate lifts the hold the moment the
plan clears (from the plan's thread: the byte bound at once for most runs, or the counts passing).
The runner asks the gate, never the plan: whether requests are held, whether the plan has passed
(``settle``, which prints it, or raises when it refuses), and tells it the in-flight counts so the
counts the byte bound made optional start once the first wave has left. The plan calls back only
into the gate.

The workers' side of the hold (workers/fleet/gate.py, the throttle's Lua, ``openrouter.warm`` and the
``warm`` call in workers/pipeline/job.py) is the throttle's: the gate only sets and lifts it.
"""

from __future__ import annotations

import logging
import time

from common.throttle import FleetThrottle
from producer.plan import PendingPlan
from producer.refusals import WriteHold

log = logging.getLogger(__name__)


class PlanGate:
    def __init__(self, plan: PendingPlan | None, throttle: FleetThrottle, hold: WriteHold) -> None:
        self._plan = plan
        self._throttle = throttle
        self._hold = hold
        self._started_s = time.monotonic()
        #: The plan's counts are in and passed (printed): nothing more to wait for.
        self.passed = plan is None
        #: Leases of every dataset at the last sample: the first wave has left once they stop growing.
        self._last_in_flight = 0

    def holds_requests(self) -> bool:
        """Whether the run's throttle must start held (the plan has not cleared the run yet)."""
        return self._plan is not None and not self._plan.cleared()

    def cleared(self) -> bool:
        """Requests may start: no plan, or it cleared the run (the byte bound, or its counts)."""
        return self._plan is None or self._plan.cleared()

    def arm(self) -> None:
        """After the throttle's reset: lift its hold the moment the plan clears (now, if it has)."""
        if self._plan is not None:
            self._plan.on_clear(self._on_clear)

    def _on_clear(self) -> None:
        """The plan's thread, the moment requests may start."""
        self._throttle.unhold()
        if self._plan is not None and self._plan.cleared_early:
            log.info("requests start %.2f s after the start, before the plan's counts: %s",
                     time.monotonic() - self._started_s, self._plan.cleared_early)

    def settle(self, *, block: bool = False) -> None:
        """Once the plan's counts are in (``block``: wait for them): print it, and let requests start
        (its thread lifted the throttle's hold already; again here in case Redis failed that call).
        A refusal (``PlanRefused``, or the count's own error) propagates: the caller ends admission."""
        if self._plan is None or self.passed or not (block or self._plan.done()):
            return
        self._plan.settle()
        self._hold(self._throttle.unhold)
        self.passed = True
        log.info("plan passed %.2f s after the start: %s", time.monotonic() - self._started_s,
                 "requests had started already" if self._plan.cleared_early else "requests start")

    def observe(self, in_flight: int, all_taken: bool) -> None:
        """Counts the byte bound made optional start once the first wave has left: requests in
        flight (``in_flight``, every dataset's) stopped growing between two samples, or every queued
        prompt was taken (``all_taken``)."""
        previous, self._last_in_flight = self._last_in_flight, in_flight
        if self._plan is None or not self._plan.awaiting_start():
            return
        if (in_flight and in_flight <= previous) or all_taken:
            log.info("the first wave has left %.2f s after the start (%s in flight): the plan's counts start",
                     time.monotonic() - self._started_s, f"{in_flight:,}")
            self._plan.start_counts()
