"""May the model's outputs train another model? Read from the models list before any request.

OpenRouter marks the models whose authors allow their text outputs to train other models
(``is_trainable_text``; shared/reference/openrouter.md "Distillation"). A model marked otherwise
is refused before anything is sent, unless the owner states ``[model] allow_non_distillable =
true``; the permission as read, when and where, goes into the manifest and the dataset card. The
requests themselves carry ``provider.enforce_distillable_text`` (``RunConfig.request_body``), so
OpenRouter refuses to serve a model that is not allowed even where the list said nothing.
"""

from __future__ import annotations

from common.config import Distillation, RunConfig
from common.endpoints import Endpoints
from common.errors import PlanRefused
from common.manifest import now_iso
from producer.models import ModelInfo


def read_permission(cfg: RunConfig, info: ModelInfo | None, base_url: str) -> Distillation:
    """The permission as the models list states it (None when it says nothing or was not read);
    ``PlanRefused`` in one line for a model that does not allow distillation, unless allowed."""
    read = Distillation(model=cfg.model.name, is_trainable_text=info.distillable if info else None,
                        read_at=now_iso(), source=Endpoints.of(base_url).models)
    if (cfg.model.upstream == "openrouter" and read.is_trainable_text is False
            and not cfg.model.allow_non_distillable):
        raise PlanRefused(f"[model] name {cfg.model.name!r}: its author does not allow its outputs to train "
                          f"other models (is_trainable_text false at {read.source}, read {read.read_at}); "
                          "choose a distillable model, or set [model] allow_non_distillable = true if your "
                          "licence allows it")
    return read
