"""Providers by choice: the model's endpoints read before the run, the pinned provider chosen, and
each provider's quantization handed to the workers (``[model] quantizations``).

``[request] providers = "route"`` (the default) leaves routing to OpenRouter and the run file's
``provider`` preferences; the rows' mix is reported (``producer/provenance.py``). ``"pin"`` sends
``provider.only = [X]`` with ``allow_fallbacks = false`` (``RequestConfig.body``), and the workers
refuse an answer from any other provider (``provider_refused``). X is ``provider_pin``, or, when the
run file names none, the plan's choice: **the cheapest endpoint** (completion price, then prompt
price, then request price; ties go to the one listed first). Cheapest, because every endpoint serves
the same model id and the pin is about one distribution, not about which; a user who cares which
(a quantization, a provider's template handling) names it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from common.config import RunConfig
from common.endpoints import Endpoints
from common.errors import ConfigError, ModelsUnavailable
from common.providers import provider_key, same_provider
from producer.models import Endpoint, fetch_endpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelEndpoints:
    """What the plan knows of the model's endpoints, and the pin it chose."""

    url: str
    endpoints: list[Endpoint] = field(default_factory=list)
    #: Why the list is unknown, when it is.
    unavailable: str | None = None
    pinned: str | None = None
    #: How the pin was chosen: "run file" or "cheapest".
    pinned_by: str | None = None

    def render(self) -> str:
        if self.unavailable:
            head = f"endpoints: unknown ({self.unavailable})"
        else:
            head = f"endpoints ({self.url}): {len(self.endpoints)}"
        lines = [head]
        for e in self.endpoints:
            price = (f"${e.pricing.prompt * 1e6:,.2f}/M prompt · ${e.pricing.completion * 1e6:,.2f}/M completion"
                     if e.pricing else "price unknown")
            context = f"context {e.context_length:,}" if e.context_length else "context unknown"
            mark = f"  ← pinned ({self.pinned_by})" if self.pinned and same_provider(e.provider, self.pinned) else ""
            lines.append(f"  {e.provider} · {e.quantization} · {context} · {price}{mark}")
        if self.pinned and not any(same_provider(e.provider, self.pinned) for e in self.endpoints):
            lines.append(f"  pinned: {self.pinned} ({self.pinned_by})")
        elif not self.pinned and len({e.provider for e in self.endpoints}) > 1:
            lines.append("  routing: OpenRouter chooses per request; the rows' mix is reported "
                         "([request] providers = \"pin\" keeps one)")
        return "\n".join(lines)


def cheapest(endpoints: list[Endpoint]) -> Endpoint | None:
    """The endpoint with the lowest completion, then prompt, then request price (the first listed
    of equals); None when none is priced."""
    priced = [(e.pricing.completion, e.pricing.prompt, e.pricing.request, i, e)
              for i, e in enumerate(endpoints) if e.pricing is not None]
    return min(priced)[-1] if priced else None


def read_endpoints(cfg: RunConfig, base_url: str) -> ModelEndpoints:
    url = Endpoints.of(base_url).model_endpoints(cfg.model.name)
    try:
        return ModelEndpoints(url=url, endpoints=fetch_endpoints(base_url, cfg.model.name))
    except ModelsUnavailable as exc:
        return ModelEndpoints(url=url, unavailable=str(exc))


def apply_endpoints(cfg: RunConfig, base_url: str) -> tuple[RunConfig, ModelEndpoints | None]:
    """The run file with each provider's quantization (where it is silent) and, under ``pin``, the
    pinned provider; the endpoints for the plan to print. An engine run has no endpoints (None).
    Raises ``ConfigError`` when a pin cannot be chosen or names a provider that does not serve the model."""
    if cfg.model.upstream != "openrouter":
        return cfg, None
    found = read_endpoints(cfg, base_url)
    model, request = cfg.model, cfg.request
    if model.quantizations is None and found.endpoints:
        model = model.model_copy(update={"quantizations": {e.provider: e.quantization for e in found.endpoints}})
    if request.providers == "pin":
        if request.provider_pin is not None:
            pinned, by = request.provider_pin, "run file"
            names = [e.provider for e in found.endpoints]
            if found.endpoints and provider_key(pinned) not in {provider_key(n) for n in names}:
                raise ConfigError(f"[request] provider_pin {pinned!r} does not serve {cfg.model.name} "
                                  f"(its endpoints: {', '.join(names)})")
        else:
            choice = cheapest(found.endpoints)
            if choice is None:
                raise ConfigError(
                    f"[request] providers = \"pin\" without provider_pin: the plan picks the cheapest endpoint, "
                    f"but {cfg.model.name}'s endpoints are unknown ({found.unavailable or 'none priced'}): "
                    "name one as [request] provider_pin")
            pinned, by = choice.provider, "cheapest"
        request = request.model_copy(update={"provider_pin": pinned})
        found = ModelEndpoints(url=found.url, endpoints=found.endpoints, unavailable=found.unavailable,
                               pinned=pinned, pinned_by=by)
        log.info("providers: pinned to %s (%s)", pinned, by)
    return cfg.model_copy(update={"model": model, "request": request}), found


def require_pin(cfg: RunConfig) -> None:
    """A pinned run names its provider by its start (the plan chooses one when the file does not)."""
    if cfg.request.providers == "pin" and not cfg.request.provider_pin:
        raise ConfigError("[request] providers = \"pin\" needs [request] provider_pin, or the plan (which pins the "
                          "cheapest endpoint): run without --no-plan, or name the provider")


__all__ = ["ModelEndpoints", "apply_endpoints", "cheapest", "read_endpoints", "require_pin"]
