"""Providers of a model: which one answers a request, honouring OpenRouter's ``provider``
preferences, and the quantization each serves at (``GET …/endpoints`` lists it).

Honoured: ``only`` (names or slugs, any case), ``ignore``, ``order`` (the first listed that is
allowed answers; with ``allow_fallbacks = false`` only the listed ones may), ``quantizations``.
Otherwise the provider is drawn per attempt from those allowed. ``provider_fallback_rate`` makes a
share of requests answer from a provider the preferences exclude: what a pin must catch in the rows
(a gateway in between that drops the preference, a fallback that should not have happened).
"""

from __future__ import annotations

import random
import re
from typing import Any

from simulator.settings import SimSettings

UNKNOWN = "unknown"
_FOLD = re.compile(r"[^a-z0-9]+")


class NoProvider(ValueError):
    """The preferences leave no provider of the model: OpenRouter's 404 ``No endpoints found``."""


def _key(name: str) -> str:
    return _FOLD.sub("", str(name).split("/", 1)[0].lower())


def quantization(s: SimSettings, provider: str) -> str:
    """The provider's quantization: ``provider_quantizations`` in the order of ``providers``."""
    try:
        i = s.providers.index(provider)
    except ValueError:
        return UNKNOWN
    return s.provider_quantizations[i] if i < len(s.provider_quantizations) else UNKNOWN


def allowed(s: SimSettings, prefs: dict[str, Any] | None) -> list[str]:
    """The providers the preferences allow, in the order they would be tried."""
    prefs = prefs or {}
    names = list(s.providers)
    if only := prefs.get("only"):
        keys = {_key(n) for n in only}
        names = [n for n in names if _key(n) in keys]
    if ignore := prefs.get("ignore"):
        keys = {_key(n) for n in ignore}
        names = [n for n in names if _key(n) not in keys]
    if quantizations := prefs.get("quantizations"):
        names = [n for n in names if quantization(s, n) in set(quantizations)]
    if order := prefs.get("order"):
        ranked = [n for key in map(_key, order) for n in names if _key(n) == key]
        rest = [] if prefs.get("allow_fallbacks") is False else [n for n in names if n not in ranked]
        names = ranked + rest
    return names


def choose(s: SimSettings, prefs: dict[str, Any] | None, rng: random.Random) -> str:
    """Who answers this attempt. Raises ``NoProvider`` when the preferences exclude every provider."""
    names = allowed(s, prefs)
    if not names:
        raise NoProvider("No endpoints found that match your provider preferences")
    if s.provider_fallback_rate and rng.random() < s.provider_fallback_rate:
        others = [n for n in s.providers if n not in names]
        if others:
            return rng.choice(others)
    if (prefs or {}).get("order"):
        return names[0]
    return rng.choice(names)


__all__ = ["NoProvider", "allowed", "choose", "quantization"]
