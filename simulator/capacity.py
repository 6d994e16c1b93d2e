"""Capacity mode: a provider that serves at most N requests at once and M per second.

A chat request that passes auth and validation meets the gate before anything else (before it
counts as an attempt of its prompt, so a capacity 429 does not change which seeded fault or answer
the prompt's next attempt gets). Above either limit it is answered 429 with ``Retry-After``
(``capacity_retry_after_s``) after ``error_latency_ms`` and is not billed.

- ``capacity_in_flight`` (N): admitted requests not yet answered. A request rejected by the gate
  does not hold a slot.
- ``capacity_per_s`` (M): admitted requests that arrived in the last second (sliding window). With
  ``capacity_count_rejected`` every arrival counts, rejected ones too, as providers that count 429s
  against you do: a fleet that keeps hammering stays locked out.

State lives on the server's one gevent hub (no locks needed, as in ``billing.Ledger``) and is
replaced by ``POST /_sim/reset``; a request releases the slot of the gate that admitted it.
"""

from __future__ import annotations

from collections import deque

from simulator.settings import SimSettings

WINDOW_S = 1.0
IN_FLIGHT = "in_flight"
PER_SECOND = "per_second"


class CapacityGate:
    def __init__(self) -> None:
        self.admitted = 0  # in flight past the gate
        self.max_admitted = 0
        self._arrivals: deque[float] = deque()  # monotonic times in the last WINDOW_S

    def _window(self, now: float) -> int:
        while self._arrivals and self._arrivals[0] <= now - WINDOW_S:
            self._arrivals.popleft()
        return len(self._arrivals)

    def admit(self, s: SimSettings, now: float) -> str | None:
        """Take a slot, or name the limit that refuses one (``in_flight`` / ``per_second``)."""
        per_s = self._window(now)
        refused: str | None = None
        if s.capacity_in_flight is not None and self.admitted >= s.capacity_in_flight:
            refused = IN_FLIGHT
        elif s.capacity_per_s is not None and per_s >= s.capacity_per_s:
            refused = PER_SECOND
        if refused is None or s.capacity_count_rejected:
            self._arrivals.append(now)
        if refused is None:
            self.admitted += 1
            self.max_admitted = max(self.max_admitted, self.admitted)
        return refused

    def release(self) -> None:
        self.admitted -= 1

    def per_s(self, now: float) -> int:
        """Arrivals counted in the last second (the per-second limit's current load)."""
        return self._window(now)
