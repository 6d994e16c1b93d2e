"""Python face of ``throttle.lua``: the fleet-wide in-flight limit, request rate and shared back-off.

Workers acquire a slot before each upstream attempt and release it with the attempt's outcome
(``workers/gate.py`` makes the waiting cheap); the producer reads ``snapshot`` for progress, metrics
and the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Literal

import redis

from common.config import ThrottleLimits
from common.keys import THROTTLE, THROTTLE_SLOTS

_SCRIPT = files("common").joinpath("throttle.lua").read_text(encoding="utf-8")

#: A 429/503 cuts the fleet's in-flight limit to this share of what the provider served during the
#: congestion event (multiplicative decrease). Gentle, because the cut starts from a measurement,
#: not from a guess, and because getting back is slow: one request per round trip (2 s at the
#: bench's latency, minutes at a long generation's). bench/throttle_run.py measured 0.9 leaving the
#: fleet ~10% under the capacity for a minute after the start; each event also costs a fleet-wide
#: Retry-After pause, so a shallower cut means a few more, cheap, events.
DEFAULT_BETA = 0.95
#: The limit is never cut below this many requests in flight.
DEFAULT_MIN_LIMIT = 4
#: 429s closer together than this are one congestion event and cut the limit once.
DEFAULT_CUT_GAP_MS = 1000
#: Answers grow the limit while the fleet has at least this share of it in flight.
DEFAULT_GROW_NEAR = 0.97

Outcome = Literal["ok", "throttled", "refused", "other"]

#: No fixed cap and no rate cap: the adaptive limit alone.
NO_CAPS = ThrottleLimits()


@dataclass(frozen=True)
class Admission:
    ok: bool
    #: When not ok: how long until asking again makes sense (0: when a slot frees), and why.
    wait_ms: int = 0
    why: str = ""
    #: When ok: how many of the slots asked for were granted (the first ones).
    granted: int = 0


@dataclass(frozen=True)
class ThrottleSnapshot:
    #: The fleet's current in-flight limit; None while no 429 has set one and no cap is configured.
    limit: float | None
    in_flight: int
    pause_ms_left: int
    ok: int
    throttled: int

    @property
    def throttled_share(self) -> float:
        total = self.ok + self.throttled
        return self.throttled / total if total else 0.0


def now_ms() -> int:
    return int(time.time() * 1000)


class FleetThrottle:
    """The caps (``ThrottleLimits``, from the run's ``[request]``) travel with every call: one
    process may serve runs with different caps, and the script clamps the learned limit to them."""

    def __init__(self, client: redis.Redis, *, beta: float = DEFAULT_BETA, min_limit: int = DEFAULT_MIN_LIMIT,
                 cut_gap_ms: int = DEFAULT_CUT_GAP_MS, grow_near: float = DEFAULT_GROW_NEAR) -> None:
        self._script = client.register_script(_SCRIPT)
        self.beta, self.min_limit, self.cut_gap_ms, self.grow_near = beta, min_limit, cut_gap_ms, grow_near

    def _call(self, *args: Any) -> Any:
        reply = self._script(keys=[THROTTLE, THROTTLE_SLOTS], args=list(args))
        if isinstance(reply, list):
            return [x.decode() if isinstance(x, bytes) else x for x in reply]
        return reply

    def acquire(self, slot: str, *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS) -> Admission:
        return self.acquire_many([slot], ttl_ms=ttl_ms, limits=limits)

    def acquire_many(self, slots: list[str], *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS) -> Admission:
        """Take as many of ``slots``, in order, as the limit and the rate allow (``granted``)."""
        reply = self._call("acquire", now_ms(), ttl_ms, limits.max_in_flight or 0, limits.max_requests_per_s or 0,
                           *slots)
        if reply[0] == "ok":
            return Admission(True, granted=int(reply[1]))
        return Admission(False, int(reply[1]), str(reply[2]))

    def release(self, slot: str, outcome: Outcome, *, retry_after_s: float | None = None,
                limits: ThrottleLimits = NO_CAPS) -> None:
        retry_after_ms = int((retry_after_s or 0) * 1000)
        self._call("release", slot, now_ms(), outcome, retry_after_ms, limits.max_in_flight or 0, self.beta,
                   self.min_limit, self.cut_gap_ms, self.grow_near)

    def snapshot(self) -> ThrottleSnapshot:
        limit, in_flight, pause_left, ok, throttled, cap = self._call("state", now_ms())
        bounds = [float(x) for x in (limit, cap) if x]  # the learned limit, the run's cap
        return ThrottleSnapshot(
            limit=min(bounds) if bounds else None,
            in_flight=int(in_flight),
            pause_ms_left=int(pause_left),
            ok=int(ok),
            throttled=int(throttled),
        )

    def reset(self, limits: ThrottleLimits = NO_CAPS) -> None:
        """A new run learns the provider's capacity from scratch (the last run's limit may belong
        to another model or provider, its counters to another run) and records its cap for
        readers. Slots of requests in flight stay."""
        self._call("reset", limits.max_in_flight or 0)
