"""Python face of ``throttle.lua``: the fleet-wide in-flight limit, request rate and shared back-off.

Workers acquire a slot before each upstream attempt and release it with the attempt's outcome
(``workers/fleet/gate.py`` makes the waiting cheap); the producer reads ``snapshot`` for progress, metrics
and the report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal

import redis

from common.config import ThrottleLimits
from common.errors import ScriptReplyError
from common.keys import THROTTLE, THROTTLE_SLOTS
from common.outcomes import Grant

_SCRIPT = files("common").joinpath("throttle.lua").read_text(encoding="utf-8")

@dataclass(frozen=True)
class ThrottlePolicy:
    """Every constant of the adaptive back-off (``throttle.lua`` states the rule)."""

    #: A congestion event cuts the fleet's in-flight limit to this share of what the provider served
    #: during it (multiplicative decrease). Gentle, because the cut starts from a measurement, not a
    #: guess, and because getting back is slow: one request per round trip (2 s at the bench's
    #: latency, minutes at a long generation's). bench/throttle_run.py measured 0.9 leaving the fleet
    #: ~10% under the capacity for a minute after the start; each event also costs a fleet-wide
    #: Retry-After pause, so a shallower cut means a few more, cheap, events.
    beta: float = 0.95
    #: The limit is never cut below this many requests in flight.
    min_limit: int = 4
    #: 429s closer together than this are one congestion event and cut the limit once.
    cut_gap_ms: int = 1000
    #: Answers grow the limit while the fleet has at least this share of it in flight.
    grow_near: float = 0.97
    #: The recent 429 share (429s per request started) is measured over one to two windows of this
    #: length...
    window_ms: int = 1000
    #: ...and judged only once they hold this many requests: a share of three is noise.
    min_requests: int = 20
    #: A 429 is congestion when the recent share exceeds the background by more than chance:
    #: noise_z standard deviations of a binomial share of that many requests, and at least margin.
    #: A provider that refuses nothing at random is cut at the first few 429s over its capacity (a
    #: margin of 2% let a fleet starting 260 requests a second send ten 429s per probe); one
    #: that refuses 10% at random, from ~19% over 100 requests or ~15% over 300.
    margin: float = 0.005
    noise_z: float = 3.0
    #: A cut is checked on at least this many requests after it (and one window): the share left is
    #: the background from then on, and a share of fewer requests strays too far (±2 points at 5%).
    check_requests: int = 100
    #: A cut after which the share stays at this fraction of what it was (or more) did not help:
    #: those 429s come whatever the load, so it is undone. A cut that relieved congestion takes the
    #: share to about nothing within a window.
    check_ratio: float = 0.5
    #: A share that survives a cut counts as background only up to this: a provider refusing more
    #: whatever the load is in trouble, and backing off is the polite answer anyway.
    background_max: float = 0.25
    #: The background share halves in this time, so a provider that stops refusing at random is
    #: watched closely again (and one that goes on refusing costs a checked cut now and then).
    background_half_life_ms: int = 120_000

    def release_args(self) -> list[float]:
        return [self.beta, self.min_limit, self.cut_gap_ms, self.grow_near, self.window_ms, self.min_requests,
                self.margin, self.background_max, self.background_half_life_ms, self.noise_z,
                self.check_requests, self.check_ratio]


POLICY = ThrottlePolicy()

#: How a throttle slot's request went, as the script learns from it (not a prompt's outcome:
#: that is ``common.outcomes.Outcome``).
SlotOutcome = Literal["ok", "throttled", "budget", "refused", "other"]

#: No fixed cap and no rate cap: the adaptive limit alone.
NO_CAPS = ThrottleLimits()


@dataclass(frozen=True)
class Release:
    """One slot given back: its outcome, the TTL it was acquired with (its start is its expiry minus
    that), the Retry-After of a 429 and the run's caps."""

    slot: str
    outcome: SlotOutcome
    ttl_ms: int
    retry_after_s: float | None = None
    limits: ThrottleLimits = NO_CAPS
    #: An answer's cost over its request's worst case: the share of one worst case it spent from
    #: the balance, by which the balance bound shrinks while the balance is known (throttle.lua;
    #: the capacity window loses nothing by it).
    drain: float = 0.0


@dataclass(frozen=True)
class SlotGrant:
    """The throttle's answer to a request for slots (whether the budget admits the prompt at all is
    ``common.budget.Admission``)."""

    ok: bool
    #: When not ok: how long until asking again makes sense (0: when a slot frees), and why.
    wait_ms: int = 0
    why: str = ""
    #: When ok: how many of the slots asked for were granted (the first ones).
    granted: int = 0


@dataclass(frozen=True)
class ThrottleSnapshot:
    #: The fleet's current in-flight limit, the lowest of the two below and the run's cap; None while
    #: none of them is set.
    limit: float | None
    in_flight: int
    pause_ms_left: int
    ok: int
    throttled: int
    #: The 429 share the provider shows whatever the load (learned from cuts that did not help).
    background_share: float = 0.0
    #: Requests the account refused for its in-flight budget (402 in_flight_budget_exhausted).
    budget_refused: int = 0
    #: The provider's capacity as learned from 429s (None: unbounded, no congestion seen yet).
    capacity_limit: float | None = None
    #: The worst-case requests the account's balance covers in flight (None: balance unknown).
    balance_limit: float | None = None

    @property
    def throttled_share(self) -> float:
        total = self.ok + self.throttled
        return self.throttled / total if total else 0.0


def grant_of(word: str) -> Grant:
    """throttle.lua acquire's first word as its member; ``ScriptReplyError`` for another."""
    if word not in set(Grant):
        raise ScriptReplyError(f"throttle.lua acquire answered {word!r}, not one of {sorted(Grant)}")
    return Grant(word)


def now_ms() -> int:
    return int(time.time() * 1000)


class FleetThrottle:
    """The caps (``ThrottleLimits``, from the run's ``[request]``) travel with every call: one
    process may serve runs with different caps, and the script clamps the learned limit to them."""

    def __init__(self, client: redis.Redis, policy: ThrottlePolicy = POLICY,
                 clock_ms: Callable[[], int] = now_ms) -> None:
        self._script = client.register_script(_SCRIPT)
        self.policy = policy
        #: Every decision is made on the caller's clock (unix ms), so a test can run a fleet's
        #: minutes against the real script in seconds.
        self._clock_ms = clock_ms

    def _call(self, *args: Any) -> Any:
        reply = self._script(keys=[THROTTLE, THROTTLE_SLOTS], args=list(args))
        if isinstance(reply, list):
            return [x.decode() if isinstance(x, bytes) else x for x in reply]
        return reply

    def acquire(self, slot: str, *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS) -> SlotGrant:
        return self.acquire_many([slot], ttl_ms=ttl_ms, limits=limits)

    def acquire_many(self, slots: list[str], *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS,
                     keep_free: int = 0) -> SlotGrant:
        """Take as many of ``slots``, in order, as the limit and the rate allow (``granted``),
        leaving ``keep_free`` of the limit's slots free for others."""
        reply = self._call("acquire", self._clock_ms(), ttl_ms, limits.max_in_flight or 0,
                           limits.max_requests_per_s or 0, self.policy.window_ms, keep_free, *slots)
        if grant_of(reply[0]) is Grant.OK:
            return SlotGrant(True, granted=int(reply[1]))
        return SlotGrant(False, int(reply[1]), str(reply[2]))

    def release(self, slot: str, outcome: SlotOutcome, *, ttl_ms: int, retry_after_s: float | None = None,
                limits: ThrottleLimits = NO_CAPS) -> None:
        """``ttl_ms``: the one the slot was acquired with (its expiry minus it is when it started)."""
        self.release_many([Release(slot, outcome, ttl_ms, retry_after_s, limits)])

    def release_many(self, releases: Sequence[Release], *, wanting: bool = False) -> None:
        """Give slots back in one call, judged one after the other in this order. ``wanting``: the
        caller is then under its share with requests waiting; borrowers keep off for a while."""
        args: list[Any] = ["release", self._clock_ms(), *self.policy.release_args(), "1" if wanting else "0"]
        for r in releases:
            args += [r.slot, r.outcome, int((r.retry_after_s or 0) * 1000), r.limits.max_in_flight or 0, r.ttl_ms,
                     repr(float(r.drain))]
        self._call(*args)

    def snapshot(self) -> ThrottleSnapshot:
        limit, in_flight, pause_left, ok, throttled, cap, background, budget, capacity, balance = self._call(
            "state", self._clock_ms(), self.policy.background_half_life_ms)
        bounds = [float(x) for x in (limit, cap) if x]  # the lower learned limit, the run's cap
        return ThrottleSnapshot(
            limit=min(bounds) if bounds else None,
            in_flight=int(in_flight),
            pause_ms_left=int(pause_left),
            ok=int(ok),
            throttled=int(throttled),
            background_share=float(background),
            budget_refused=int(budget),
            capacity_limit=float(capacity) if capacity else None,
            balance_limit=float(balance) if balance else None,
        )

    def reset(self, limits: ThrottleLimits = NO_CAPS, *, hold: bool = False) -> None:
        """A new run learns the provider's capacity from scratch (the last run's limit may belong
        to another model or provider, its counters to another run) and records its cap for
        readers. Slots of requests in flight stay. ``hold``: no request starts until ``unhold``
        (the run's plan is still counting; workers prepare their prompts meanwhile). The balance
        bound starts at ``limits.start_in_flight`` (what the account's balance covers, from the
        plan) when it is set; the capacity window starts unbounded either way."""
        self._call("reset", limits.max_in_flight or 0, "1" if hold else "0", limits.start_in_flight or 0)

    def unhold(self) -> None:
        """The plan passed: requests may start. Idempotent."""
        self._call("unhold")
