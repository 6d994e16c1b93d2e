"""Usage, cost and the billing ledger: what the simulator charged, to compare billed with kept.

Billing follows openrouter.md: a non-streamed answer is billed in full once generated, whether or
not its client is still there (a client that timed out still pays); an error status, a dropped
connection and a 200-with-error are not billed. A streamed answer whose client leaves is billed in
full or for what was sent, per ``stream_abort_billed``.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from simulator.capacity import IN_FLIGHT, PER_SECOND, CapacityGate
from simulator.series import InFlightSeries
from simulator.settings import SimSettings

MAX_RECORDS = 500_000  # generation records kept for /api/v1/generation; oldest dropped first


@dataclass(frozen=True)
class BilledUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "cost": self.cost,
        }


def priced(prompt: int, completion: int, reasoning: int, cached: int, *,
           price_in_per_mtok: float, price_out_per_mtok: float,
           price_request_usd: float = 0.0) -> BilledUsage:
    # Reasoning is part of completion and billed at the completion price (pricing.internal_reasoning
    # is published as 0); cached prompt tokens are not discounted (input_cache_read = prompt).
    cost = (prompt * price_in_per_mtok + completion * price_out_per_mtok) / 1e6 + price_request_usd
    return BilledUsage(prompt, completion, reasoning, cached, round(cost, 12))


def with_overrides(usage: BilledUsage, overrides: Mapping[str, float], *,
                   price_in_per_mtok: float, price_out_per_mtok: float,
                   price_request_usd: float = 0.0) -> BilledUsage:
    """A ``#sim`` ``usage`` override; cost is recomputed unless it is overridden too."""
    if not overrides:
        return usage
    fields = {k: int(overrides.get(k, getattr(usage, k))) for k in
              ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens")}
    new = priced(fields["prompt_tokens"], fields["completion_tokens"], fields["reasoning_tokens"],
                 fields["cached_tokens"], price_in_per_mtok=price_in_per_mtok,
                 price_out_per_mtok=price_out_per_mtok, price_request_usd=price_request_usd)
    if "cost" in overrides:
        new = BilledUsage(**{**asdict(new), "cost": float(overrides["cost"])})
    return new


@dataclass(frozen=True)
class GenerationRecord:
    id: str
    prompt_hash: str
    model: str
    provider: str
    usage: BilledUsage
    finish_reason: str
    native_finish_reason: str
    fault: str | None
    streamed: bool
    abandoned: bool  # billed, but the client was gone when the answer was ready
    latency_ms: float
    created: float  # unix time of the request
    ended_mono: float  # time.monotonic() at the end, for the generation endpoint's 404 window
    engine_ids: bool = False  # answered with token ids (return_token_ids)
    noncanonical: Mapping[str, Any] | None = None  # the injected split (engine_ids.Injection)

    def stats_json(self) -> dict[str, Any]:
        """The ``data`` of ``GET /api/v1/generation``."""
        return {
            "id": self.id,
            "model": self.model,
            "provider_name": self.provider,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
            "streamed": self.streamed,
            "cancelled": self.abandoned,
            "latency": round(self.latency_ms),
            "generation_time": round(self.latency_ms),
            "finish_reason": self.finish_reason,
            "native_finish_reason": self.native_finish_reason,
            "tokens_prompt": self.usage.prompt_tokens,
            "tokens_completion": self.usage.completion_tokens,
            "native_tokens_prompt": self.usage.prompt_tokens,
            "native_tokens_completion": self.usage.completion_tokens,
            "native_tokens_reasoning": self.usage.reasoning_tokens,
            "native_tokens_cached": self.usage.cached_tokens,
            "total_cost": self.usage.cost,
            "usage": self.usage.cost,
        }

    def detail_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt_hash": self.prompt_hash,
            "fault": self.fault,
            "finish_reason": self.finish_reason,
            "streamed": self.streamed,
            "abandoned": self.abandoned,
            "prompt_tokens": self.usage.prompt_tokens,
            "completion_tokens": self.usage.completion_tokens,
            "reasoning_tokens": self.usage.reasoning_tokens,
            "cost": self.usage.cost,
            "engine_ids": self.engine_ids,
            "noncanonical": dict(self.noncanonical) if self.noncanonical else None,
        }


class Ledger:
    """Every counter ``GET /_sim/stats`` reports. Only touched from the server's gevent hub, so it
    needs no lock (greenlets switch only at I/O, never inside these methods)."""

    def __init__(self, series_interval_s: float = 0.5) -> None:
        self.started_mono = time.monotonic()
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.gate = CapacityGate()
        self.capacity_429s: Counter[str] = Counter()
        self.series = InFlightSeries(self.started_mono, series_interval_s)
        self.scripted = 0
        self.by_status: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()
        self.billed: Counter[str] = Counter()
        self.billed_cost = 0.0
        self.abandoned: Counter[str] = Counter()
        self.engine_id_answers = 0
        self.noncanonical_answers = 0
        self.records: OrderedDict[str, GenerationRecord] = OrderedDict()

    def enter(self, interval_s: float) -> None:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.series.record(time.monotonic(), interval_s, in_flight=self.in_flight,
                           admitted=self.gate.admitted, arrived=True)

    def admit(self, settings: SimSettings) -> str | None:
        """The capacity gate (``capacity.py``): None when admitted, else the limit hit."""
        now = time.monotonic()
        refused = self.gate.admit(settings, now)
        if refused is not None:
            self.capacity_429s[refused] += 1
        self.series.record(now, settings.series_interval_s, in_flight=self.in_flight,
                           admitted=self.gate.admitted)
        return refused

    def leave(self, status: str, interval_s: float, *, admitted: bool,
              capacity_429: bool = False) -> None:
        self.in_flight -= 1
        if admitted:
            self.gate.release()
        self.by_status[status] += 1
        self.series.record(time.monotonic(), interval_s, in_flight=self.in_flight,
                           admitted=self.gate.admitted, status=status, capacity_429=capacity_429)

    def bill(self, record: GenerationRecord) -> None:
        u = record.usage
        self.billed.update(requests=1, prompt_tokens=u.prompt_tokens,
                           completion_tokens=u.completion_tokens,
                           reasoning_tokens=u.reasoning_tokens, cached_tokens=u.cached_tokens)
        self.billed_cost += u.cost
        self.finish_reasons[record.finish_reason] += 1
        if record.abandoned:
            self.abandoned.update(requests=1, completion_tokens=u.completion_tokens)
        self.engine_id_answers += record.engine_ids
        self.noncanonical_answers += record.noncanonical is not None
        self.records[record.id] = record
        if len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)

    def snapshot(self, *, detail: bool = False, series_since_s: float | None = None,
                 ) -> dict[str, Any]:
        # Flat billed_* names, as in the run's summary.json, so the two compare key by key.
        billed_keys = ("requests", "prompt_tokens", "completion_tokens", "reasoning_tokens",
                       "cached_tokens")
        out: dict[str, Any] = {
            "requests": self.requests,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "admitted_in_flight": self.gate.admitted,
            "max_admitted_in_flight": self.gate.max_admitted,
            "per_s_window": self.gate.per_s(time.monotonic()),
            "capacity_429s": sum(self.capacity_429s.values()),
            "capacity_429s_by_limit": {k: self.capacity_429s[k] for k in (IN_FLIGHT, PER_SECOND)},
            "scripted": self.scripted,
            "by_status": dict(self.by_status),
            "faults": dict(self.faults),
            "finish_reasons": dict(self.finish_reasons),
            **{f"billed_{k}": self.billed[k] for k in billed_keys},
            "billed_cost_usd": round(self.billed_cost, 9),
            **{f"abandoned_{k}": self.abandoned[k] for k in ("requests", "completion_tokens")},
            "engine_id_answers": self.engine_id_answers,
            "noncanonical_answers": self.noncanonical_answers,
            "uptime_s": round(time.monotonic() - self.started_mono, 3),
        }
        if series_since_s is not None:
            out["series"] = self.series.to_json(series_since_s)
        if detail:
            out["generations"] = [r.detail_json() for r in self.records.values()]
            out["noncanonical_generations"] = [
                r.id for r in self.records.values() if r.noncanonical is not None]
        return out
