"""What to do after a failed upstream attempt: retry (after how long), fail the prompt, or halt.

The decision is made here, on the error's class (``common.errors``), never on an HTTP status in
the caller: ``RetryableUpstreamError`` retries with jittered exponential backoff until the attempts
run out (``UpstreamTimeoutError``, an attempt past its ``timeout_s``, is one); ``FatalUpstreamError``
fails the prompt (``AnswerTooLargeError`` as ``answer_too_large``, ``WeightExceedsBudgetError`` as
``weight_exceeds_budget``); ``InFlightBudgetError`` retries after its ``Retry-After`` without spending
one of the prompt's attempts (the account refused it before it ran; the fleet's throttle has cut
the in-flight limit and paused every worker meanwhile), until the prompt has waited
``in_flight_wait_max_s`` since its first such refusal (then it fails ``in_flight_budget_exhausted``);
``AccountRefusedError`` halts the fleet at once (every prompt would fail alike);
``MisconfiguredError`` halts the fleet once it has been met on ``misconfig_prompts`` distinct
prompts with no answer in between (``DatasetStats`` keeps that streak), and until then is retried,
since one such answer may be a prompt's own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from common.config import RetryConfig
from common.contract import (
    FAIL_ANSWER_TOO_LARGE,
    FAIL_IN_FLIGHT_BUDGET,
    FAIL_MISCONFIGURED,
    FAIL_RETRIES_EXHAUSTED,
    FAIL_UPSTREAM_FATAL,
    FAIL_WEIGHT_EXCEEDS_BUDGET,
    HALT_MISCONFIGURED,
)
from common.errors import (
    AccountRefusedError,
    AnswerTooLargeError,
    InFlightBudgetError,
    MisconfiguredError,
    RetryableUpstreamError,
    UpstreamError,
    WeightExceedsBudgetError,
)

#: Attempts per prompt, the first included (``[retry] max_attempts`` overrides).
DEFAULT_MAX_ATTEMPTS = RetryConfig.model_fields["max_attempts"].default
#: Backoff ceiling of the first retry; it doubles per attempt (``[retry] backoff_base_s``).
DEFAULT_BACKOFF_BASE_S = RetryConfig.model_fields["backoff_base_s"].default
#: Longest backoff between two attempts (``[retry] backoff_max_s``); a ``Retry-After`` can exceed it.
DEFAULT_BACKOFF_MAX_S = RetryConfig.model_fields["backoff_max_s"].default
#: Longest a prompt waits on repeated in-flight budget 402s (``[retry] in_flight_wait_max_s``).
DEFAULT_IN_FLIGHT_WAIT_MAX_S = RetryConfig.model_fields["in_flight_wait_max_s"].default
#: Distinct prompts that must meet a "wrong URL or model" answer, with no answer anywhere in
#: between, before the fleet halts: one is possibly the prompt's own (no provider serves its
#: tools), three in a row with nothing succeeding is the configuration.
DEFAULT_MISCONFIG_PROMPTS = 3

Action = Literal["retry", "fail", "halt"]


@dataclass(frozen=True)
class Decision:
    action: Action
    #: ``fail``: the failure reason (``contract.FAIL_*``); ``halt``: the halt reason; else "".
    reason: str = ""
    #: ``retry``: seconds to wait before the next attempt.
    delay_s: float = 0.0
    #: Whether the failed attempt counts against ``max_attempts``: not when the account refused it
    #: before it ran (the in-flight budget), which says nothing about the prompt.
    spends_attempt: bool = True


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


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff_base_s: float = DEFAULT_BACKOFF_BASE_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    misconfig_prompts: int = DEFAULT_MISCONFIG_PROMPTS
    in_flight_wait_max_s: float = DEFAULT_IN_FLIGHT_WAIT_MAX_S

    @classmethod
    def from_config(cls, retry: RetryConfig) -> RetryPolicy:
        return cls(retry.max_attempts, retry.backoff_base_s, retry.backoff_max_s,
                   in_flight_wait_max_s=retry.in_flight_wait_max_s)

    def decide(
        self, error: UpstreamError, attempt: int, *, misconfigured_prompts: int = 0, in_flight_waited_s: float = 0.0,
        rng: random.Random | None = None
    ) -> Decision:
        """After attempt number ``attempt`` (1-based) failed with ``error``.

        ``misconfigured_prompts``: distinct prompts in the fleet's misconfiguration streak,
        this one included (only read for a ``MisconfiguredError``). ``in_flight_waited_s``: seconds
        since the prompt's first in-flight budget 402 (only read for an ``InFlightBudgetError``)."""
        if isinstance(error, AccountRefusedError):
            return Decision("halt", error.reason)
        if isinstance(error, InFlightBudgetError):
            # Its Retry-After, jittered a little so the refused requests do not come back at once.
            wait_s = error.retry_after_s or self.backoff_base_s
            uniform = rng.uniform if rng is not None else random.uniform
            delay = wait_s + uniform(0, wait_s / 2)
            if in_flight_waited_s + delay > self.in_flight_wait_max_s:
                return Decision("fail", FAIL_IN_FLIGHT_BUDGET, spends_attempt=False)
            return Decision("retry", delay_s=delay, spends_attempt=False)
        if isinstance(error, MisconfiguredError):
            if misconfigured_prompts >= self.misconfig_prompts:
                return Decision("halt", HALT_MISCONFIGURED)
            if attempt >= self.max_attempts:
                return Decision("fail", FAIL_MISCONFIGURED)
        elif isinstance(error, AnswerTooLargeError):
            return Decision("fail", FAIL_ANSWER_TOO_LARGE)
        elif isinstance(error, WeightExceedsBudgetError):
            return Decision("fail", FAIL_WEIGHT_EXCEEDS_BUDGET)
        elif not isinstance(error, RetryableUpstreamError):
            return Decision("fail", FAIL_UPSTREAM_FATAL)
        if attempt >= self.max_attempts:
            return Decision("fail", FAIL_RETRIES_EXHAUSTED)
        delay = backoff_s(attempt, error, base_s=self.backoff_base_s, max_s=self.backoff_max_s, rng=rng)
        return Decision("retry", delay_s=delay)

    def attempt_window_s(self, timeout_s: float) -> float:
        """Longest one attempt plus the wait after it can take: what a lease must cover."""
        return timeout_s * 1.2 + self.backoff_max_s


__all__ = ["DEFAULT_MISCONFIG_PROMPTS", "Decision", "RetryPolicy", "backoff_s"]
