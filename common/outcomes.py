"""A prompt's outcome, one word for one meaning from budget.lua's reply to the task's result.

``Outcome`` is a ``StrEnum``: a member is its word (``Outcome.KEPT == "kept"``), so what Celery logs
and Flower shows as a task's result, and what a spool entry or a log line says, stays the word.
Budget replies are decoded into members once, in ``common/budget.py`` (``reply_outcome``); past it the
code compares members, never strings. throttle.lua's acquire answers a ``Grant``, decoded once in
``common/throttle.py`` (``grant_of``). This module is the words alone: it imports nothing of ours.

Who answers what:

- budget.lua's worker operations (``REPLIES``: tests/test_outcomes.py checks the table against the
  script, so a new reply word without a member fails there):
  reserve → ok | done | stopped | busy | over | wait | halted;
  renew → ok | done | stopped | halted | lost;
  settle → kept | duplicate | discarded; fail → failed | duplicate; release → released.
- the worker itself: ``spooled`` (Redis away: the settle or fail waits in the local spool),
  ``skipped:stopped`` / ``skipped:over`` (a task's result when its dataset stopped or its budget
  is full), ``dead_letter`` (a message that is not a task of ours).

A task's result is one of kept, failed (a settle's ``discarded`` is reported as failed: billed,
recorded as over_budget), duplicate, done, halted, spooled, skipped:stopped, skipped:over, dead_letter.
"""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    # budget.lua reserve: admitted, or why not
    OK = "ok"
    DONE = "done"  # kept, or failed in this run, by some delivery
    STOPPED = "stopped"
    BUSY = "busy"  # another delivery holds a live lease
    OVER = "over"  # the budget is full
    WAIT = "wait"  # full until requests in flight land
    HALTED = "halted"  # the fleet is halted (account refused)
    # budget.lua renew
    LOST = "lost"  # the lease was reaped meanwhile
    # budget.lua settle / fail / release
    KEPT = "kept"
    DUPLICATE = "duplicate"  # another delivery kept the prompt; billed, row dropped
    DISCARDED = "discarded"  # the hard cap had no room for the answer; billed, failed over_budget
    FAILED = "failed"
    RELEASED = "released"
    # the worker's own
    SPOOLED = "spooled"
    SKIPPED_STOPPED = "skipped:stopped"
    SKIPPED_OVER = "skipped:over"
    DEAD_LETTER = "dead_letter"
    #: batch mode (workers/pipeline/batch/): the prompt waits in a submitted batch; its outcome comes with the results
    BATCHED = "batched"


#: The words each of budget.lua's worker operations can answer (the first element of its reply).
REPLIES: dict[str, frozenset[Outcome]] = {
    "reserve": frozenset({Outcome.OK, Outcome.DONE, Outcome.STOPPED, Outcome.BUSY, Outcome.OVER, Outcome.WAIT,
                          Outcome.HALTED}),
    "renew": frozenset({Outcome.OK, Outcome.DONE, Outcome.STOPPED, Outcome.HALTED, Outcome.LOST}),
    "settle": frozenset({Outcome.KEPT, Outcome.DUPLICATE, Outcome.DISCARDED}),
    "fail": frozenset({Outcome.FAILED, Outcome.DUPLICATE}),
    "release": frozenset({Outcome.RELEASED}),
}

#: A task whose reserve found its dataset stopped or its budget full ends as skipped:<that word>.
SKIPPED: dict[Outcome, Outcome] = {Outcome.STOPPED: Outcome.SKIPPED_STOPPED, Outcome.OVER: Outcome.SKIPPED_OVER}


class Grant(enum.StrEnum):
    """throttle.lua acquire's first word (tests/test_outcomes.py checks the script answers these only)."""

    OK = "ok"  # slots granted: how many follows
    WAIT = "wait"  # none: how long until asking again makes sense, and why (hold | pause | limit | rate)


__all__ = ["REPLIES", "SKIPPED", "Grant", "Outcome"]
