"""The simulator's one typed settings object.

The same field names are CLI flags (``latency_median_ms`` → ``--latency-median-ms``), keys of a
``--config FILE`` JSON and keys of a ``POST /_sim/config`` partial update, so one validator serves
all three and its errors name the field (``rates.429: must be a number in 0..1``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from simulator.faults import FAULTS


class SettingsError(ValueError):
    """A setting is wrong; the message starts with the field's name."""


REASONING_FIELDS = ("reasoning", "reasoning_content", "details")


@dataclass(frozen=True)
class LengthDistribution:
    """Token-length distributions (lognormal with this mean and sd) for one class of request.

    A request uses the class with the largest ``min_max_tokens`` not above its ``max_tokens``
    (the largest class when it sends none), so the client's short/long datasets, which differ in
    ``max_tokens``, get short/long answers without telling the simulator anything else.
    """

    min_max_tokens: int = 0
    reasoning_mean: float = 400.0
    reasoning_sd: float = 200.0
    content_mean: float = 250.0
    content_sd: float = 120.0


def _default_classes() -> Mapping[str, LengthDistribution]:
    return types.MappingProxyType(
        {
            "short": LengthDistribution(),
            # Above the client's short max_tokens (8192), below its long one (32768). Long answers
            # spend thousands of tokens reasoning, as Kimi does, so budgets drain realistically.
            "long": LengthDistribution(16384, 2500.0, 1200.0, 900.0, 400.0),
        }
    )


def _meta(help_text: str, *, lo: float | None = None, hi: float | None = None,
          fixed: bool = False, choices: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"help": help_text, "lo": lo, "hi": hi, "fixed": fixed, "choices": choices}


@dataclass(frozen=True)
class SimSettings:
    # --- fixed at start-up (not changeable through /_sim/config) ---
    host: str = field(default="127.0.0.1", metadata=_meta("address to bind", fixed=True))
    port: int = field(default=8765, metadata=_meta("port (0: any free port)", lo=0, hi=65535,
                                                   fixed=True))
    tokenizer: str | None = field(default=None, metadata=_meta(
        "HF tokenizer dir (or tokenizer.json) to count tokens with; default: word-ish pieces",
        fixed=True))
    # --- who may call, what is answered ---
    seed: int = field(default=0, metadata=_meta("seed of every answer, latency and fault draw"))
    expect_key: str | None = field(default=None, metadata=_meta(
        "accept only this bearer key (default: any non-empty key)"))
    model: str = field(default="moonshotai/kimi-k2.5", metadata=_meta(
        "model named in answers when the request names none"))
    models: tuple[str, ...] = field(default=("moonshotai/kimi-k2.5",), metadata=_meta(
        "model ids served (with ``model``); any other id answers 404 \"No endpoints found for …\""
        " (comma-separated on the CLI)"))
    non_distillable_models: tuple[str, ...] = field(default=(), metadata=_meta(
        "served models whose authors do not allow distillation: listed with is_trainable_text false, "
        "and refused (404) to a request with provider.enforce_distillable_text (comma-separated on the CLI)"))
    context_length: int = field(default=262144, metadata=_meta(
        "context length published and enforced: prompt + max_tokens above it is a 400", lo=1))
    max_completion_tokens: int | None = field(default=65536, metadata=_meta(
        "top_provider.max_completion_tokens published by the models endpoint (null: none)", lo=1))
    providers: tuple[str, ...] = field(
        default=("Moonshot AI", "Together", "Fireworks", "Parasail"),
        metadata=_meta("provider names to pick from (comma-separated on the CLI)"))
    provider_quantizations: tuple[str, ...] = field(default=(), metadata=_meta(
        "each provider's quantization, in the order of providers (the endpoints list's; missing: \"unknown\")"))
    provider_fallback_rate: float = field(default=0.0, metadata=_meta(
        "share of requests answered by a provider their provider preferences exclude (providers.py)", lo=0, hi=1))
    price_in_per_mtok: float = field(default=0.60, metadata=_meta("USD per 1M prompt tokens", lo=0))
    price_out_per_mtok: float = field(default=2.50, metadata=_meta(
        "USD per 1M completion tokens (reasoning included)", lo=0))
    price_request_usd: float = field(default=0.0, metadata=_meta(
        "USD per billed request (pricing.request)", lo=0))
    credit_limit_usd: float | None = field(default=None, metadata=_meta(
        "answer 402 once this much has been billed (GET /api/v1/key reports it)", lo=0))
    # --- the account (account.py): balance and the in-flight spending budget ---
    balance_usd: float | None = field(default=None, metadata=_meta(
        "the account's credits: running requests' estimates (prompt + max_tokens) are capped against "
        "what is left of it, with the three 402s (null: no balance, no in-flight budget)", lo=0))
    in_flight_retry_after_s: float = field(default=1.0, metadata=_meta(
        "Retry-After of the in_flight_budget_exhausted 402", lo=0))
    management_key: str | None = field(default=None, metadata=_meta(
        "only this bearer key may read GET /api/v1/credits, any other gets 403 (null: any key)"))
    # --- latency: lognormal with this median and p99, plus time per completion token ---
    latency_median_ms: float = field(default=400.0, metadata=_meta("median latency", lo=0))
    latency_p99_ms: float | None = field(default=None, metadata=_meta(
        "99th percentile latency (null: 4 x median)", lo=0))
    per_token_ms: float = field(default=0.0, metadata=_meta("added per completion token", lo=0))
    error_latency_ms: float = field(default=20.0, metadata=_meta(
        "latency of HTTP error replies (errors come back fast)", lo=0))
    # --- answer shapes ---
    tool_call_rate: float = field(default=0.5, metadata=_meta(
        "with tools sent: share of answers that are structured tool_calls", lo=0, hi=1))
    raw_tool_text_rate: float = field(default=0.5, metadata=_meta(
        "no tools sent but tools declared in the prompt: share answered with raw Kimi "
        "tool-call token text in content", lo=0, hi=1))
    null_content_rate: float = field(default=0.5, metadata=_meta(
        "share of tool-call answers whose content is null rather than \"\"", lo=0, hi=1))
    reasoning_field: str = field(default="reasoning", metadata=_meta(
        "where reasoning goes: reasoning | reasoning_content | details (reasoning_details only)",
        choices=REASONING_FIELDS))
    reasoning_details: bool = field(default=False, metadata=_meta(
        "also send reasoning_details[] beside the reasoning field"))
    cached_fraction: float = field(default=0.0, metadata=_meta(
        "share of prompt tokens reported cached on a prompt's repeat attempts", lo=0, hi=1))
    length_classes: Mapping[str, LengthDistribution] = field(default_factory=_default_classes,
                                                      metadata=_meta("length classes"))
    # --- engine-ids mode (engine_ids.py): requests with return_token_ids ---
    noncanonical_rate: float = field(default=0.0, metadata=_meta(
        "share of token-id answers whose ids hold one non-canonical tokenization of their text",
        lo=0, hi=1))
    # --- faults ---
    usage_skew_rate: float = field(default=0.0, metadata=_meta(
        "share of answers (seeded per prompt) billed usage_skew_tokens more completion tokens than generated, "
        "as a provider counting with another tokenizer", lo=0, hi=1))
    usage_skew_tokens: int = field(default=1, metadata=_meta(
        "completion tokens a usage_skew_rate answer is billed beyond its own"))
    rates: Mapping[str, float] = field(default_factory=lambda: types.MappingProxyType({}),
                                       metadata=_meta("fault rates by name, plus leak_im_end"))
    retry_after_s: float | None = field(default=1.0, metadata=_meta(
        "Retry-After on 429/503 (null: none)", lo=0))
    hang_s: float = field(default=30.0, metadata=_meta("how long hang/hang_drop hold", lo=0))
    trickle_every_s: float = field(default=1.0, metadata=_meta(
        "trickle: seconds between two bytes of the reply", lo=0.001))
    trickle_s: float = field(default=30.0, metadata=_meta(
        "trickle: how long the reply trickles before the rest comes at once", lo=0))
    generation_delay_s: float = field(default=2.0, metadata=_meta(
        "GET /api/v1/generation answers 404 this long after a request ends", lo=0))
    # --- capacity mode (capacity.py): 429 above N in flight or M per second ---
    capacity_in_flight: int | None = field(default=None, metadata=_meta(
        "answer 429 while this many admitted requests are in flight (null: no limit)", lo=0))
    capacity_per_s: int | None = field(default=None, metadata=_meta(
        "answer 429 once this many requests were admitted in the last second (null: no limit)",
        lo=0))
    capacity_retry_after_s: float | None = field(default=1.0, metadata=_meta(
        "Retry-After on capacity 429s (null: none)", lo=0))
    capacity_count_rejected: bool = field(default=False, metadata=_meta(
        "rejected requests count against capacity_per_s too (429s held against you)"))
    series_interval_s: float = field(default=0.5, metadata=_meta(
        "bucket width of the in-flight series in /_sim/stats?series=1", lo=0.01))
    # --- the Batch API (batch.py) ---
    batch_models: tuple[str, ...] = field(default=("*",), metadata=_meta(
        "served models with a :batch variant (\"*\": all of them; comma-separated on the CLI)"))
    batch_discount: float = field(default=0.5, metadata=_meta(
        "a batch's per-token price as a share of the live price", lo=0, hi=1))
    batch_validate_s: float = field(default=2.0, metadata=_meta("a batch stays validating this long", lo=0))
    batch_run_s: float = field(default=20.0, metadata=_meta(
        "a batch stays in_progress this long, its answers coming in evenly", lo=0))
    batch_finalize_s: float = field(default=1.0, metadata=_meta("a batch stays finalizing this long", lo=0))
    batch_expire_rate: float = field(default=0.0, metadata=_meta(
        "share of batches that expire (seeded per batch) instead of completing", lo=0, hi=1))
    batch_expire_done: float = field(default=0.5, metadata=_meta(
        "share of an expiring batch's requests answered before it expires", lo=0, hi=1))
    batch_submit_delay_s: float = field(default=0.0, metadata=_meta(
        "hold the answer to POST /api/v1/batches this long after the batch is stored (a lost answer)", lo=0))
    batch_submit_drop: int = field(default=0, metadata=_meta(
        "the next N POSTs /api/v1/batches are read and never stored, their answers held as "
        "batch_submit_delay_s (a POST lost on its way: nothing to find, nothing billed)", lo=0))
    batch_error_rate: float = field(default=0.0, metadata=_meta(
        "share of batch requests (seeded per request) that fail with an error result", lo=0, hi=1))
    # --- streaming ---
    keepalive_s: float = field(default=1.0, metadata=_meta(
        "interval of ': OPENROUTER PROCESSING' comments before the first token", lo=0.001))
    stream_chunk_tokens: int = field(default=8, metadata=_meta("tokens per stream chunk", lo=1))
    stream_abort_billed: bool = field(default=True, metadata=_meta(
        "bill a stream in full when its client goes away (false: bill what was sent)"))

    def updated(self, patch: Mapping[str, Any], *, allow_fixed: bool = False) -> SimSettings:
        """A copy with ``patch`` applied; ``rates`` and ``length_classes`` merge key by key."""
        if not isinstance(patch, Mapping):
            raise SettingsError("settings: expected a JSON object")
        known = {f.name: f for f in dataclasses.fields(self)}
        hints = typing.get_type_hints(SimSettings)
        changes: dict[str, Any] = {}
        for name, value in patch.items():
            f = known.get(name)
            if f is None:
                raise SettingsError(f"{name}: unknown setting")
            if f.metadata["fixed"] and not allow_fixed:
                raise SettingsError(f"{name}: fixed at start-up, cannot be changed at runtime")
            if name == "rates":
                changes[name] = _merge_rates(self.rates, value)
            elif name == "length_classes":
                changes[name] = _merge_classes(self.length_classes, value)
            else:
                changes[name] = _coerce(name, hints[name], value, f.metadata)
        new = dataclasses.replace(self, **changes)
        if new.latency_p99_ms is not None and new.latency_p99_ms < new.latency_median_ms:
            raise SettingsError("latency_p99_ms: must not be below latency_median_ms")
        return new

    @property
    def served_models(self) -> tuple[str, ...]:
        """``model`` (the default of a request naming none) is always served."""
        return tuple(dict.fromkeys((self.model, *self.models)))

    def prices(self) -> dict[str, float]:
        """The keyword arguments of ``billing.priced``: what is billed is what is published."""
        return {"price_in_per_mtok": self.price_in_per_mtok,
                "price_out_per_mtok": self.price_out_per_mtok,
                "price_request_usd": self.price_request_usd}

    @property
    def p99_ms(self) -> float:
        # A spread that scales with the median, so --latency-median-ms alone gives a sane shape.
        return self.latency_p99_ms if self.latency_p99_ms is not None else 4 * self.latency_median_ms

    def to_json(self) -> dict[str, Any]:
        """Current settings as JSON; the expected key is masked, it is a secret."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "length_classes":
                value = {k: dataclasses.asdict(c) for k, c in value.items()}
            elif f.name == "rates":
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        if self.expect_key is not None:
            out["expect_key"] = "<set>"
        if self.management_key is not None:
            out["management_key"] = "<set>"
        return out


def settings_fields() -> list[tuple[dataclasses.Field[Any], Any]]:
    """Each field with its resolved type hint, for building CLI flags."""
    hints = typing.get_type_hints(SimSettings)
    return [(f, hints[f.name]) for f in dataclasses.fields(SimSettings)]


def _coerce(name: str, hint: Any, value: Any, meta: Mapping[str, Any]) -> Any:
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None:
        if optional:
            return None
        raise SettingsError(f"{name}: must not be null")
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if base is bool:
        if not isinstance(value, bool):
            raise SettingsError(f"{name}: expected true or false")
        return value
    if base is int or base is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SettingsError(f"{name}: expected a number")
        if base is int and value != int(value):
            raise SettingsError(f"{name}: expected an integer")
        number = int(value) if base is int else float(value)
        if not math.isfinite(number):
            raise SettingsError(f"{name}: must be finite")
        _check_range(name, number, meta.get("lo"), meta.get("hi"))
        return number
    if base is str:
        if not isinstance(value, str):
            raise SettingsError(f"{name}: expected a string")
        choices = meta.get("choices") or ()
        if choices and value not in choices:
            raise SettingsError(f"{name}: must be one of {', '.join(choices)}")
        return value
    if typing.get_origin(base) is tuple:  # providers
        if (not isinstance(value, list | tuple) or not value
                or not all(isinstance(v, str) and v for v in value)):
            raise SettingsError(f"{name}: expected a non-empty list of names")
        return tuple(value)
    raise SettingsError(f"{name}: cannot be set this way")  # pragma: no cover - schema bug


def _check_range(name: str, number: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and number < lo:
        raise SettingsError(f"{name}: must be >= {lo:g}")
    if hi is not None and number > hi:
        raise SettingsError(f"{name}: must be <= {hi:g}")


#: A rate that is not a fault: it modifies otherwise good answers, independently of the faults.
LEAK_IM_END = "leak_im_end"
#: Degenerate answers (answers.py), one draw per prompt against their cumulative rates, apart from
#: the faults: a sentence repeated to the answer's length; reasoning then empty content; reasoning
#: never closed (the model ends its turn inside it: content null, no think-close).
DEGENERATE_KINDS = ("degenerate_repeat", "degenerate_empty", "degenerate_unclosed")
_SHAPE_RATES = (LEAK_IM_END, *DEGENERATE_KINDS)


def _merge_rates(current: Mapping[str, float], patch: Any) -> Mapping[str, float]:
    if not isinstance(patch, Mapping):
        raise SettingsError("rates: expected an object of fault name -> rate")
    merged = dict(current)
    for name, rate in patch.items():
        if name not in FAULTS and name not in _SHAPE_RATES:
            known = ", ".join((*FAULTS, *_SHAPE_RATES))
            raise SettingsError(f"rates.{name}: unknown fault (known: {known})")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise SettingsError(f"rates.{name}: must be a number in 0..1")
        merged[name] = float(rate)
    # One draw walks the cumulative fault rates, so their sum is the share of faulted attempts.
    if sum(v for k, v in merged.items() if k not in _SHAPE_RATES) > 1 + 1e-9:
        raise SettingsError("rates: fault rates must sum to at most 1")
    if sum(v for k, v in merged.items() if k in DEGENERATE_KINDS) > 1 + 1e-9:
        raise SettingsError("rates: degenerate_* rates must sum to at most 1")
    return types.MappingProxyType({k: v for k, v in merged.items() if v > 0})


def _merge_classes(current: Mapping[str, LengthDistribution], patch: Any) -> Mapping[str, LengthDistribution]:
    if not isinstance(patch, Mapping):
        raise SettingsError("length_classes: expected an object of class name -> fields")
    merged = dict(current)
    names = {f.name for f in dataclasses.fields(LengthDistribution)}
    for cls_name, fields_patch in patch.items():
        where = f"length_classes.{cls_name}"
        if fields_patch is None:  # null removes a class
            merged.pop(cls_name, None)
            continue
        if not isinstance(fields_patch, Mapping):
            raise SettingsError(f"{where}: expected an object")
        base = merged.get(cls_name, LengthDistribution())
        values = dataclasses.asdict(base)
        for key, value in fields_patch.items():
            if key not in names:
                raise SettingsError(f"{where}.{key}: unknown field")
            hint = int if key == "min_max_tokens" else float
            values[key] = _coerce(f"{where}.{key}", hint, value, _meta("", lo=0))
        merged[cls_name] = LengthDistribution(**values)
    if not merged:
        raise SettingsError("length_classes: at least one class is needed")
    return types.MappingProxyType(merged)
