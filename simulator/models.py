"""The model catalogue: ``GET /api/v1/models`` and ``/api/v1/models/{author}/{slug}/endpoints``.

Built from the same settings the chat route bills with (``SimSettings.prices()``), so a client that
prices a run from the catalogue gets exactly what the ledger charges: per token
``price_in_per_mtok / 1e6`` (prompt) and ``price_out_per_mtok / 1e6`` (completion, reasoning
included), plus ``price_request_usd`` per billed request. Prices are decimal strings, never
scientific notation, as OpenRouter writes them.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from simulator.providers import quantization
from simulator.settings import SimSettings

CREATED = 1769040000  # a fixed listing date, so the catalogue is the same in every run

SUPPORTED_PARAMETERS = (
    "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_p", "logit_bias", "response_format",
    "structured_outputs", "reasoning", "include_reasoning", "tools", "tool_choice",
)


def per_token(per_mtok: float) -> str:
    """USD per 1M tokens as OpenRouter's USD-per-token string: 0.6 → ``"0.0000006"``."""
    value = Decimal(repr(float(per_mtok))) / Decimal(1_000_000)
    return _plain(value)


def _plain(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if Decimal(text) == 0 else text


def pricing_json(s: SimSettings) -> dict[str, str]:
    prompt = per_token(s.price_in_per_mtok)
    return {
        "prompt": prompt,
        "completion": per_token(s.price_out_per_mtok),
        "request": _plain(Decimal(repr(float(s.price_request_usd)))),
        "image": "0",
        "web_search": "0",
        # Reasoning tokens are completion tokens, billed at the completion price.
        "internal_reasoning": "0",
        # The simulator does not discount cached prompt tokens.
        "input_cache_read": prompt,
    }


def display_name(model_id: str) -> str:
    """``moonshotai/kimi-k2.5`` → ``Moonshotai: Kimi K2.5``."""
    author, _, slug = model_id.partition("/")
    words = " ".join(w[:1].upper() + w[1:] for w in slug.replace("-", " ").split())
    return f"{author[:1].upper() + author[1:]}: {words}" if slug else model_id


def _architecture() -> dict[str, Any]:
    return {"modality": "text->text", "input_modalities": ["text"],
            "output_modalities": ["text"], "tokenizer": "Other", "instruct_type": None}


def model_json(model_id: str, s: SimSettings) -> dict[str, Any]:
    """One ``data[]`` entry of ``GET /api/v1/models``."""
    return {
        "id": model_id,
        "canonical_slug": model_id,
        "name": display_name(model_id),
        "created": CREATED,
        "description": f"{display_name(model_id)}, served by the local OpenRouter simulator.",
        "context_length": s.context_length,
        "architecture": _architecture(),
        "pricing": pricing_json(s),
        "top_provider": {"context_length": s.context_length,
                         "max_completion_tokens": s.max_completion_tokens,
                         "is_moderated": False},
        "per_request_limits": None,
        "supported_parameters": list(SUPPORTED_PARAMETERS),
        "default_parameters": {},
        # Whether the model's author allows its text outputs to train other models (the models
        # page's "Distillable" filter): what provider.enforce_distillable_text routes on.
        "is_trainable_text": distillable(model_id.removesuffix(":batch"), s),
    }


def distillable(model_id: str, s: SimSettings) -> bool:
    return model_id not in s.non_distillable_models


def batch_model_json(model_id: str, s: SimSettings) -> dict[str, Any]:
    """The ``<id>:batch`` entry of a model with a batch variant: its own, discounted pricing."""
    entry = model_json(f"{model_id}:batch", s)
    discount = Decimal(repr(float(s.batch_discount)))
    entry["pricing"] = {**entry["pricing"], **{
        k: _plain(Decimal(entry["pricing"][k]) * discount) for k in ("prompt", "completion", "input_cache_read")}}
    return entry


def models_json(s: SimSettings) -> dict[str, Any]:
    batch = [m for m in s.served_models if "*" in s.batch_models or m in s.batch_models]
    return {"data": [model_json(m, s) for m in s.served_models] + [batch_model_json(m, s) for m in batch]}


def endpoints_json(model_id: str, s: SimSettings) -> dict[str, Any] | None:
    """``GET /api/v1/models/{author}/{slug}/endpoints``: one endpoint per provider, all at the
    simulator's one price. None when the model is not served."""
    if model_id not in s.served_models:
        return None
    base = model_json(model_id, s)
    endpoints = [{
        "name": f"{provider} | {model_id}",
        "model_name": base["name"],
        "context_length": s.context_length,
        "pricing": pricing_json(s),
        "provider_name": provider,
        "tag": provider.lower().replace(" ", "-"),
        "quantization": quantization(s, provider),
        "max_completion_tokens": s.max_completion_tokens,
        "max_prompt_tokens": None,
        "supported_parameters": list(SUPPORTED_PARAMETERS),
        "status": 0,
        "uptime_last_30m": 100.0,
        "supports_implicit_caching": False,
    } for provider in s.providers]
    return {"data": {
        "id": model_id,
        "name": base["name"],
        "created": CREATED,
        "description": base["description"],
        "architecture": base["architecture"],
        "endpoints": endpoints,
    }}


def no_endpoints_message(model_id: str) -> str:
    """OpenRouter's words for a model id it cannot route (seen with code 404)."""
    return f"No endpoints found for {model_id}."


def not_distillable_message(model_id: str) -> str:
    """The 404 of a request with ``provider.enforce_distillable_text`` for a model whose author does
    not allow distillation: no endpoint qualifies."""
    return (f"No endpoints found for {model_id} that allow distillation "
            "(provider.enforce_distillable_text is set).")


def context_error_message(s: SimSettings, prompt_tokens: int, max_tokens: int) -> str:
    """OpenRouter's 400 when prompt + max_tokens exceed the context length."""
    return (f"This endpoint's maximum context length is {s.context_length} tokens. However, you "
            f"requested about {prompt_tokens + max_tokens} tokens ({prompt_tokens} of text input, "
            f"{max_tokens} in the output). Please reduce the length of either one, or use the "
            "\"middle-out\" transform to compress your prompt automatically.")
