"""The model's price and context length, from the models endpoint (``GET {root}/models``).

Public on OpenRouter (no key is sent). Prices come as strings of USD per token (per request for
``request``); they become floats here. The URL comes from the base URL as ``common/endpoints.py``
derives every route.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass
from typing import Any

import requests

from common.config import Pricing
from common.endpoints import Endpoints
from common.errors import ModelsUnavailable, PriceUnusable, UnknownModel

log = logging.getLogger(__name__)

MODELS_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ModelInfo:
    id: str
    context_length: int | None
    pricing: Pricing | None
    #: The price of its Batch API variant (``<id>:batch`` in the list); None: it has none.
    batch_pricing: Pricing | None = None
    #: ``is_trainable_text``: its author allows its text outputs to train other models (None: the
    #: list does not say). Best-effort information, recorded with the time it was read.
    distillable: bool | None = None


#: How the models list names a model's Batch API variant (shared/reference/openrouter.md "Batch API").
BATCH_SUFFIX = ":batch"


def _price(raw: Any, field: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise PriceUnusable(f"pricing.{field} {raw!r} is not a number") from None
    if value < 0:  # OpenRouter lists "-1" for router models whose price is not fixed
        raise PriceUnusable(f"pricing.{field} {raw!r} is negative")
    return value


def parse_model(entry: dict[str, Any]) -> ModelInfo:
    context = entry.get("context_length")
    context_length = int(context) if isinstance(context, int | float) and context > 0 else None
    pricing: Pricing | None = None
    raw = entry.get("pricing")
    if isinstance(raw, dict):
        try:
            pricing = Pricing(prompt=_price(raw.get("prompt"), "prompt"),
                                   completion=_price(raw.get("completion"), "completion"),
                                   request=_price(raw.get("request", 0) or 0, "request"))
        except ValueError as exc:  # PriceUnusable, or a Pricing the model refuses
            log.warning("model %s: price not usable (%s): prices unknown", entry.get("id"), exc)
    trainable = entry.get("is_trainable_text")
    return ModelInfo(id=str(entry["id"]), context_length=context_length, pricing=pricing,
                     distillable=trainable if isinstance(trainable, bool) else None)


def _get_json(url: str, timeout_s: float) -> Any:
    """``GET url``'s JSON body (public endpoints: no key is sent); ``ModelsUnavailable`` naming the URL
    when it cannot be reached, does not answer 200, or is not JSON."""
    try:
        resp = requests.get(url, timeout=timeout_s, headers={"Accept": "application/json"})
    except requests.RequestException as exc:
        raise ModelsUnavailable(f"GET {url}: {type(exc).__name__}") from None
    if resp.status_code != 200:
        raise ModelsUnavailable(f"GET {url}: HTTP {resp.status_code}")
    try:
        return resp.json()
    except ValueError:
        raise ModelsUnavailable(f"GET {url}: not JSON") from None


def fetch_model(base_url: str, model_id: str, *, timeout_s: float = MODELS_TIMEOUT_S) -> ModelInfo:
    """The model's entry, or ``UnknownModel`` naming the URL and close ids, or ``ModelsUnavailable``."""
    url = Endpoints.of(base_url).models
    body = _get_json(url, timeout_s)
    try:
        data = body["data"]
        listed = {str(e["id"]): e for e in data if isinstance(e, dict) and "id" in e}
    except (ValueError, KeyError, TypeError):
        raise ModelsUnavailable(f"GET {url}: not a models list") from None
    # A ``:batch`` entry is a variant of its model, not a model to name in [model] name.
    entries = {k: v for k, v in listed.items() if not k.endswith(BATCH_SUFFIX)}
    entry = entries.get(model_id)
    if entry is None:
        close = difflib.get_close_matches(model_id, list(entries), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UnknownModel(f"[model] name {model_id!r} is not a model at {url} "
                           f"({len(entries):,} models listed){hint}")
    info = parse_model(entry)
    variant = listed.get(model_id + BATCH_SUFFIX)
    if variant is not None:
        info = dataclasses.replace(info, batch_pricing=parse_model(variant).pricing)
    return info


# --- the model's endpoints: who serves it, at which quantization and price ------------------------


@dataclass(frozen=True)
class Endpoint:
    """One provider's endpoint of the model (``GET /api/v1/models/{author}/{slug}/endpoints``)."""

    provider: str
    quantization: str
    context_length: int | None
    pricing: Pricing | None
    tag: str = ""


def parse_endpoint(entry: dict[str, Any]) -> Endpoint:
    info = parse_model({"id": entry.get("name") or entry.get("provider_name") or "?",
                        "context_length": entry.get("context_length"), "pricing": entry.get("pricing")})
    return Endpoint(provider=str(entry.get("provider_name") or ""), quantization=str(entry.get("quantization") or "?"),
                    context_length=info.context_length, pricing=info.pricing, tag=str(entry.get("tag") or ""))


def fetch_endpoints(base_url: str, model_id: str, *, timeout_s: float = MODELS_TIMEOUT_S) -> list[Endpoint]:
    """The model's endpoints, in the order listed; ``ModelsUnavailable`` naming the URL when the
    list cannot be read (public on OpenRouter: no key is sent)."""
    url = Endpoints.of(base_url).model_endpoints(model_id)
    body = _get_json(url, timeout_s)
    try:
        entries = body["data"]["endpoints"]
        return [parse_endpoint(e) for e in entries if isinstance(e, dict) and e.get("provider_name")]
    except (ValueError, KeyError, TypeError):
        raise ModelsUnavailable(f"GET {url}: not an endpoints list") from None
