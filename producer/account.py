"""The account behind the key, for the plan: its balance and key limit, and how many worst-case
requests the balance covers in flight (openrouter.md "Account: key limits and credits", "The
in-flight spending budget").

``GET {root}/key`` gives the key's ``limit`` (null: none) and ``limit_remaining``;
``GET {root}/credits`` gives ``total_credits`` and ``total_usage``, whose difference is the
balance. The credits endpoint needs a management key: its 403 means "unknown", not an error, and
so does any other failure of either endpoint (said in the plan, never a refusal by itself).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import requests

from common.config import LengthClass, Pricing
from common.endpoints import Endpoints

log = logging.getLogger(__name__)

ACCOUNT_TIMEOUT_S = 10.0
ACCOUNT_RETRY_PAUSE_S = 1.0


@dataclass(frozen=True)
class Account:
    #: credits less usage; None: unknown (``balance_unknown`` says why).
    balance_usd: float | None = None
    total_credits_usd: float | None = None
    #: The key's spending limit (None: no limit, or unknown) and what is left of it.
    key_limit_usd: float | None = None
    key_remaining_usd: float | None = None
    key_known: bool = False
    balance_unknown: str = ""
    key_unknown: str = ""

    @property
    def spendable_usd(self) -> float | None:
        """What the key can spend: the balance and the key's limit left, the lower known one."""
        known = [v for v in (self.balance_usd, self.key_remaining_usd) if v is not None]
        return min(known) if known else None


def _get(url: str, api_key: str, timeout_s: float) -> tuple[int, Any]:
    """GET ``url``; asked once more after a connection error, a timeout, a 429 or a 5xx, since one
    passing hiccup would otherwise leave the plan without the balance (and so without the in-flight
    bound it starts the fleet from) for the whole run."""
    headers = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
    try:
        resp = requests.get(url, timeout=timeout_s, headers=headers)
        transient = resp.status_code == 429 or resp.status_code >= 500
    except (requests.ConnectionError, requests.Timeout):
        transient = True
    if transient:
        time.sleep(ACCOUNT_RETRY_PAUSE_S)
        resp = requests.get(url, timeout=timeout_s, headers=headers)
    try:
        body = resp.json()
    except ValueError:
        body = None
    return resp.status_code, body


def _number(raw: Any) -> float | None:
    return float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) else None


def fetch_account(base_url: str, api_key: str | None, *, timeout_s: float = ACCOUNT_TIMEOUT_S) -> Account:
    """The key's limit and the account's balance; what cannot be read is unknown, with why."""
    if not api_key:
        return Account(balance_unknown="no OPENROUTER_API_KEY", key_unknown="no OPENROUTER_API_KEY")
    routes = Endpoints.of(base_url)
    fields: dict[str, Any] = {}
    try:
        status, body = _get(routes.key, api_key, timeout_s)
        data = body.get("data") if isinstance(body, dict) else None
        if status == 200 and isinstance(data, dict):
            fields.update(key_known=True, key_limit_usd=_number(data.get("limit")),
                          key_remaining_usd=_number(data.get("limit_remaining")))
        else:
            fields["key_unknown"] = f"GET {routes.key}: HTTP {status}"
    except requests.RequestException as exc:
        fields["key_unknown"] = f"GET {routes.key}: {type(exc).__name__}"
    try:
        status, body = _get(routes.credits, api_key, timeout_s)
        data = body.get("data") if isinstance(body, dict) else None
        credits = _number(data.get("total_credits")) if isinstance(data, dict) else None
        usage = _number(data.get("total_usage")) if isinstance(data, dict) else None
        if status == 200 and credits is not None:
            fields.update(total_credits_usd=credits, balance_usd=max(0.0, credits - (usage or 0.0)))
        elif status == 403:
            fields["balance_unknown"] = "the credits endpoint needs a management key (403)"
        else:
            fields["balance_unknown"] = f"GET {routes.credits}: HTTP {status}"
    except requests.RequestException as exc:
        fields["balance_unknown"] = f"GET {routes.credits}: {type(exc).__name__}"
    return Account(**fields)


def worst_request_usd(pricing: Pricing, length: LengthClass, prompt_tokens: float) -> float:
    """One request as the in-flight budget estimates it: its prompt and ``max_tokens`` at the price."""
    return prompt_tokens * pricing.prompt + length.max_tokens * pricing.completion + pricing.request


def fit_in_flight(balance_usd: float, worst_usd: float) -> int:
    """Worst-case requests the balance covers in flight at once (at least one: one request over the
    whole balance is the prompt's own failure, weight_exceeds_budget)."""
    if worst_usd <= 0:
        return 0
    return max(1, math.floor(balance_usd / worst_usd))
