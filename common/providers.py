"""Provider names as OpenRouter spells them in different places, made comparable, and the key a
row's weights are counted under.

An answer names its provider by display name (``"DeepInfra"``), the endpoints API by
``provider_name`` (the same) and a tag (``"deepinfra/fp4"``), and ``provider.only`` takes either the
name or the slug (``"deepinfra"``). ``provider_key`` folds them into one spelling so a pin matches
whichever form the user wrote.
"""

from __future__ import annotations

import re

#: Quantization of a provider the endpoints list does not name (or that no list was read for).
UNKNOWN_QUANTIZATION = "?"
_FOLD = re.compile(r"[^a-z0-9]+")


def provider_key(name: str) -> str:
    """``"DeepInfra"``, ``"deepinfra"``, ``"Deep Infra"`` -> ``"deepinfra"``; a tag's quantization
    part (``"deepinfra/fp4"``) is not part of the provider."""
    return _FOLD.sub("", name.split("/", 1)[0].lower())


def same_provider(a: str, b: str) -> bool:
    return provider_key(a) == provider_key(b)


def quantization_of(quantizations: dict[str, str] | None, provider: str) -> str:
    """The quantization ``provider`` serves at, from a provider -> quantization map (the endpoints
    list); ``UNKNOWN_QUANTIZATION`` when it does not name the provider."""
    key = provider_key(provider)
    for name, quantization in (quantizations or {}).items():
        if provider_key(name) == key:
            return quantization
    return UNKNOWN_QUANTIZATION


def mix_key(provider: str, quantization: str | None) -> str:
    """What a row is counted under in the provider mix: ``"<provider>|<quantization>"``."""
    return f"{provider or '?'}|{quantization or UNKNOWN_QUANTIZATION}"


__all__ = ["UNKNOWN_QUANTIZATION", "mix_key", "provider_key", "quantization_of", "same_provider"]
