"""The failures the simulator can inject: their names, how one is picked, and how each one replies.

Every fault has a rate in ``SimSettings.rates`` (0..1, summing to at most 1) and can also be forced
for one prompt's first attempts by a ``#sim`` script's ``fail_attempts``. Picking uses an RNG seeded
by (seed, prompt hash, attempt number), so the n-th attempt of a prompt meets the same fault in
every run, whatever order thousands of concurrent requests arrive in.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Every fault name, in the fixed order used to walk cumulative rates.
FAULTS: tuple[str, ...] = (
    "429",  # rate limited; carries Retry-After unless retry_after_s is null
    "502",  # model down or bad upstream answer
    "503",  # no provider meets the routing requirements; carries Retry-After like 429
    "408",  # upstream timeout
    "402",  # out of credits, no Retry-After: a client must not retry
    "402_retry",  # in-flight budget: 402 *with* Retry-After, the one 402 worth retrying
    "400",
    "401",
    "403",  # moderation / guardrail
    "hang",  # hold the connection hang_s, then answer normally (billed)
    "hang_drop",  # hold hang_s, then close the connection with no answer (not billed)
    "bad_json",  # 200 whose body is cut in half (billed: the tokens were generated)
    "error200",  # 200 with an error object, null content and zero usage (not billed)
    "stream_error",  # streaming only: some chunks, then an error chunk with finish_reason "error"
    # Headers at once, then the reply one byte every trickle_every_s for trickle_s, then the rest
    # (billed): a per-read socket timeout never trips on it, only a deadline on the whole attempt.
    # Last in the order, so switching it on leaves which fault every other draw meets unchanged.
    "trickle",
)

#: Faults answered with a plain HTTP error status before any generation.
HTTP_FAULTS: frozenset[str] = frozenset(
    {"429", "502", "503", "408", "402", "402_retry", "400", "401", "403"}
)


def fault_name(entry: object) -> str:
    """A ``fail_attempts`` entry (``429`` or ``"hang"``) as a fault name; ValueError if unknown."""
    if isinstance(entry, bool) or not isinstance(entry, int | str):
        raise ValueError(f"{entry!r} is not a status or fault name")
    name = str(entry)
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
    return name


def pick_fault(rates: Mapping[str, float], rng: random.Random) -> str | None:
    """One draw against the cumulative rates; None means answer normally."""
    draw = rng.random()
    acc = 0.0
    for name in FAULTS:
        acc += rates.get(name, 0.0)
        if draw < acc:
            return name
    return None


@dataclass(frozen=True)
class ErrorReply:
    status: int
    body: dict[str, Any]
    retry_after_s: float | None = None


def error_body(
    code: int | str, message: str, metadata: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if metadata:
        error["metadata"] = dict(metadata)
    return {"error": error}


def http_error(
    name: str, *, model: str, provider: str, retry_after_s: float | None
) -> ErrorReply:
    """The reply for an HTTP fault, worded like OpenRouter's."""
    if name == "429":
        return ErrorReply(
            429,
            error_body(429, f"Rate limit exceeded: {model}", {"provider_name": provider}),
            retry_after_s,
        )
    if name == "502":
        meta: dict[str, Any] = {"provider_name": provider, "raw": "upstream connect error"}
        return ErrorReply(502, error_body(502, "Provider returned error", meta))
    if name == "503":
        msg = "No endpoints found that can handle the requested parameters."
        return ErrorReply(503, error_body(503, msg), retry_after_s)
    if name == "408":
        return ErrorReply(408, error_body(408, "Request timed out", {"provider_name": provider}))
    if name == "402":
        msg = "Insufficient credits. Add more credits to continue."
        return ErrorReply(402, error_body(402, msg))
    if name == "402_retry":
        msg = "Request exceeds the in-flight credit budget; retry later."
        meta = {"limit_source": "openrouter_in_flight_budget"}
        # Without a Retry-After this 402 would read as "out of credits", so it always has one.
        return ErrorReply(402, error_body(402, msg, meta), retry_after_s or 1.0)
    if name == "400":
        return ErrorReply(400, error_body(400, "Invalid request: provider rejected parameters"))
    if name == "401":
        return ErrorReply(401, error_body(401, "User not found."))
    if name == "403":
        flagged = {"reasons": ["violence"], "flagged_input": "…",
                   "provider_name": provider, "model_slug": model}
        return ErrorReply(403, error_body(403, f"{model} requires moderation: flagged", flagged))
    raise ValueError(f"{name!r} is not an HTTP fault")


class AttemptBook:
    """How many times each prompt (by hash of its messages) has been asked, so ``fail_attempts``
    and seeded faults follow the attempt number rather than arrival order."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def next(self, prompt_hash: str) -> int:
        """Count one more attempt and return its 1-based number."""
        n = self._seen.get(prompt_hash, 0) + 1
        self._seen[prompt_hash] = n
        return n

    def clear(self) -> None:
        self._seen.clear()
