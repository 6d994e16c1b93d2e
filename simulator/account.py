"""The account behind the key: its balance, the in-flight spending budget, and the two account
endpoints (openrouter.md "The in-flight spending budget", "Account: key limits and credits").

OpenRouter charges a request when it finishes, so it estimates every paid request still running at
its prompt plus ``max_tokens`` at the model's price and caps the sum against the balance (credits
less what was billed). With ``balance_usd`` set, a chat request that passed validation meets this
budget before the capacity gate and before it counts as an attempt of its prompt:

- balance used up: 402 ``Insufficient credits`` (``limit_source = openrouter_credits``), no
  ``Retry-After``: the account is out of money;
- its own estimate over the whole balance left: 402 ``reason = weight_exceeds_budget``, no
  ``Retry-After``: no retry helps;
- its estimate beside those of the requests running over the balance left: 402
  ``reason = in_flight_budget_exhausted``, ``limit_source = openrouter_in_flight_budget``, with
  ``Retry-After`` (``in_flight_retry_after_s``): it clears as running requests settle.

Otherwise its estimate is held until the request ends (answered, failed or dropped). None of the
three is billed. ``GET /api/v1/credits`` reports ``total_credits`` (the balance setting) and
``total_usage`` (what was billed); it needs a management key: with ``management_key`` set, any other
key is answered 403, and with no ``balance_usd`` the balance is unknown, so it answers 403 too.

State lives on the server's one gevent hub, like ``billing.Ledger``, and is replaced by
``POST /_sim/reset``.
"""

from __future__ import annotations

import hmac
from collections import Counter
from dataclasses import dataclass
from typing import Any

from simulator.faults import error_body
from simulator.settings import SimSettings

IN_FLIGHT_BUDGET = "in_flight_budget_exhausted"
WEIGHT_EXCEEDS_BUDGET = "weight_exceeds_budget"
INSUFFICIENT_CREDITS = "insufficient_credits"


@dataclass(frozen=True)
class BudgetRefusal:
    status: int
    body: dict[str, Any]
    retry_after_s: float | None
    kind: str


def estimate_usd(s: SimSettings, prompt_tokens: int, max_tokens: int | None) -> float:
    """A running request's worst case: its prompt and ``max_tokens`` (else what the model may
    still write) at the published price."""
    completion = max_tokens or s.max_completion_tokens or max(0, s.context_length - prompt_tokens)
    return (prompt_tokens * s.price_in_per_mtok + completion * s.price_out_per_mtok) / 1e6 + s.price_request_usd


class InFlightBudget:
    """The sum of the running requests' estimates, held against the balance left."""

    def __init__(self) -> None:
        self.held_usd = 0.0
        self.holding = 0
        self.max_held_usd = 0.0
        self.refused: Counter[str] = Counter()

    def admit(self, s: SimSettings, estimate: float, billed_usd: float) -> BudgetRefusal | None:
        """Hold ``estimate`` (None), or the 402 that refuses it. ``billed_usd``: billed so far."""
        if s.balance_usd is None:
            return None
        left = s.balance_usd - billed_usd
        refusal = None
        if left <= 0:
            refusal = BudgetRefusal(402, error_body(402, "Insufficient credits. Add more credits to continue.",
                                                    {"limit_source": "openrouter_credits"}), None,
                                    INSUFFICIENT_CREDITS)
        elif estimate > left:
            refusal = BudgetRefusal(402, error_body(
                402, f"This request's estimated cost (${estimate:.4f}) exceeds your available credits "
                     f"(${left:.4f}); lower max_tokens or add credits.",
                {"reason": WEIGHT_EXCEEDS_BUDGET, "limit_source": "openrouter_credits"}), None,
                WEIGHT_EXCEEDS_BUDGET)
        elif self.held_usd + estimate > left:
            refusal = BudgetRefusal(402, error_body(
                402, "This request would exceed your available credits given your current in-flight requests. "
                     "Retry later.",
                {"reason": IN_FLIGHT_BUDGET, "limit_source": "openrouter_in_flight_budget"}),
                s.in_flight_retry_after_s, IN_FLIGHT_BUDGET)
        if refusal is not None:
            self.refused[refusal.kind] += 1
            return refusal
        self.held_usd += estimate
        self.holding += 1
        self.max_held_usd = max(self.max_held_usd, self.held_usd)
        return None

    def release(self, estimate: float) -> None:
        self.held_usd = max(0.0, self.held_usd - estimate)
        self.holding -= 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "held_usd": round(self.held_usd, 9),
            "holding": self.holding,
            "max_held_usd": round(self.max_held_usd, 9),
            "refused": {k: self.refused[k] for k in (IN_FLIGHT_BUDGET, WEIGHT_EXCEEDS_BUDGET, INSUFFICIENT_CREDITS)},
        }


def credits_reply(s: SimSettings, token: str, billed_usd: float) -> tuple[int, dict[str, Any]]:
    """``GET /api/v1/credits`` for the bearer ``token`` (already authenticated)."""
    if s.balance_usd is None or (s.management_key is not None
                                 and not hmac.compare_digest(token.encode(), s.management_key.encode())):
        return 403, error_body(403, "Only management keys can fetch credits")
    return 200, {"data": {"total_credits": s.balance_usd, "total_usage": round(billed_usd, 9)}}
