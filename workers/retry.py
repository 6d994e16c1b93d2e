"""When to try the upstream call again: jittered exponential backoff that honours Retry-After."""

from __future__ import annotations

import random

from common.errors import UpstreamError


def backoff_s(
    attempt: int, error: UpstreamError, *, base_s: float, max_s: float, rng: random.Random | None = None
) -> float:
    """Delay before attempt ``attempt + 1``.

    "Equal jitter" (half fixed, half random) spreads a burst of 429s from 1,000 greenlets without
    ever retrying immediately; a server's ``Retry-After`` is a floor, not a suggestion.
    """
    uniform = rng.uniform if rng is not None else random.uniform
    ceiling = min(max_s, base_s * 2 ** (attempt - 1))
    delay = ceiling / 2 + uniform(0, ceiling / 2)
    if error.retry_after_s is not None:
        delay = max(delay, error.retry_after_s)
    return delay
