"""Sampling recipes: which of a dataset's mixture (``[[datasets]] sampling``) a prompt is asked with.

Chosen by a stable hash of the prompt's id (sha256, not Python's salted ``hash``): the same recipe
for the same id in every process, worker and rerun, so a resumed or repeated run asks each prompt
as before. The ids' hashes are uniform, so each recipe gets its share of the prompts.
"""

from __future__ import annotations

import hashlib
from typing import Any

from common.config import SamplingRecipe, WorkerView

_SPAN = float(1 << 64)


def position(prompt_id: str) -> float:
    """The id's place in [0, 1): the first 8 bytes of its sha256."""
    return int.from_bytes(hashlib.sha256(prompt_id.encode("utf-8")).digest()[:8], "big") / _SPAN


def recipe_for(recipes: list[SamplingRecipe], prompt_id: str) -> SamplingRecipe:
    """The recipe whose share, in the order listed, covers the id's position."""
    at, acc = position(prompt_id), 0.0
    for recipe in recipes:
        acc += recipe.share
        if at < acc:
            return recipe
    return recipes[-1]  # shares sum to 1 within rounding


def sampled(view: WorkerView, dataset: str, prompt_id: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The request's body keys with the prompt's recipe over them, and what its row records of it
    (``{"recipe": name, <parameters>}``; None: the dataset names no mixture)."""
    recipes = view.sampling.get(dataset)
    if not recipes:
        return view.request, None
    recipe = recipe_for(recipes, prompt_id)
    params = recipe.params()
    return {**view.request, **params}, {"recipe": recipe.label(), **params}
