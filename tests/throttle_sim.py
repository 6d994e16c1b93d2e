"""A fleet against a provider on a virtual clock, deciding through the real ``throttle.lua``.

Minutes of a fleet's life run in seconds: every acquire and release goes to the real script on the
test's Valkey, with the virtual time as its clock (``FleetThrottle(clock_ms=...)``); only the
provider and the waiting are simulated. The fleet is ``clients`` greenlets, each sending one request
after another; like ``workers/fleet/gate.py`` a process's waiting requests are granted in one call per
``POLL_MS`` (or at once when a release frees a slot). The provider serves ``capacity`` requests in
flight (above it: 429 at once) and refuses ``random_429`` of the rest whatever the load. A 429 makes
its client wait the Retry-After before asking again (``workers/pipeline/retry.py``).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from common.config import ThrottleLimits
from common.throttle import POLICY, FleetThrottle, Release, SlotOutcome, ThrottlePolicy

T0_MS = 1_700_000_000_000
POLL_MS = 50
TTL_MS = 600_000
MAX_BATCH = 200


@dataclass(frozen=True)
class Provider:
    #: Requests in flight it serves; None: no limit.
    capacity: int | None = None
    #: Share of requests refused (429) whatever the load.
    random_429: float = 0.0
    latency_ms: int = 1000
    #: Share of requests that hang until the client's timeout (an "other" outcome: not about capacity).
    hang: float = 0.0
    hang_ms: int = 8000
    error_latency_ms: int = 10
    retry_after_ms: int = 1000


@dataclass
class FleetRun:
    rows: int = 0
    #: (virtual ms since start, provider's in flight, fleet limit or None, paused) every POLL_MS.
    samples: list[tuple[int, int, float | None, bool]] = field(default_factory=list)
    #: (virtual ms since start, throttled?) for every answer.
    outcomes: list[tuple[int, bool]] = field(default_factory=list)
    background_share: float = 0.0

    def _mean(self, after_ms: int, pick: Callable[[tuple[int, int, float | None, bool]], float]) -> float:
        seen = [pick(s) for s in self.samples if s[0] >= after_ms]
        return sum(seen) / len(seen)

    def mean_in_flight(self, after_ms: int) -> float:
        return self._mean(after_ms, lambda s: s[1])

    def paused_share(self, after_ms: int) -> float:
        return self._mean(after_ms, lambda s: s[3])

    def unbounded_share(self, after_ms: int) -> float:
        """Share of the time the fleet had no learned limit (none set, or a cut undone)."""
        return self._mean(after_ms, lambda s: s[2] is None)

    def share_429(self, after_ms: int) -> float:
        seen = [thr for t, thr in self.outcomes if t >= after_ms]
        return sum(seen) / max(len(seen), 1)


def run_fleet(client: redis.Redis, provider: Provider, *, clients: int, duration_ms: int, adaptive: bool = True,
              policy: ThrottlePolicy = POLICY, seed: int = 7, start_in_flight: int | None = None,
              drain: float = 0.0) -> FleetRun:
    """``start_in_flight``: the worst cases the account's balance covers, as the plan hands it on
    (None: unknown); ``drain``: what each answer takes off it, in worst cases."""
    rng = random.Random(seed)
    now = T0_MS
    throttle = FleetThrottle(client, policy, clock_ms=lambda: now)
    throttle.reset(ThrottleLimits(start_in_flight=start_in_flight))
    run = FleetRun()
    seq = itertools.count()
    # (time, seq, kind, slot, outcome): "answer" ends a request, "ready" puts a client back in line.
    events: list[tuple[int, int, str, str, SlotOutcome]] = []
    waiting: list[str] = [f"c{i}" for i in range(clients)]
    admitted = 0  # the provider's requests in flight
    next_poll = now

    def send(slot: str) -> None:
        nonlocal admitted
        if (provider.capacity is not None and admitted >= provider.capacity) or rng.random() < provider.random_429:
            heapq.heappush(events, (now + provider.error_latency_ms, next(seq), "answer", slot, "throttled"))
            return
        if rng.random() < provider.hang:
            heapq.heappush(events, (now + provider.hang_ms, next(seq), "answer", slot, "other"))
            return
        admitted += 1
        latency = int(provider.latency_ms * rng.uniform(0.8, 1.2))
        heapq.heappush(events, (now + latency, next(seq), "answer", slot, "ok"))

    while now < T0_MS + duration_ms:
        if events and events[0][0] <= next_poll:
            now, _, kind, slot, outcome = heapq.heappop(events)
            if kind == "ready":
                waiting.append(slot)
                continue
            if outcome == "ok":
                admitted -= 1
                run.rows += 1
            if outcome == "other":
                throttle.release(slot, "other", ttl_ms=TTL_MS)
                heapq.heappush(events, (now, next(seq), "ready", slot, "ok"))
                continue
            run.outcomes.append((now - T0_MS, outcome == "throttled"))
            retry_after_s = provider.retry_after_ms / 1000 if outcome == "throttled" else None
            told: SlotOutcome = outcome if adaptive or outcome == "ok" else "refused"
            throttle.release_many([Release(slot, told, TTL_MS, retry_after_s, drain=drain if outcome == "ok" else 0.0)])
            back_at = now + (provider.retry_after_ms if outcome == "throttled" else 0)
            heapq.heappush(events, (back_at, next(seq), "ready", slot, "ok"))
            next_poll = min(next_poll, now)  # a freed slot wakes the gate at once
            continue
        now = next_poll
        if waiting:
            admission = throttle.acquire_many(waiting[:MAX_BATCH], ttl_ms=TTL_MS)
            if admission.ok:
                granted, waiting = waiting[:admission.granted], waiting[admission.granted:]
                for slot in granted:
                    send(slot)
        snap = throttle.snapshot()
        run.samples.append((now - T0_MS, admitted, snap.limit, snap.pause_ms_left > 0))
        next_poll = now + POLL_MS
    run.background_share = throttle.snapshot().background_share
    return run
