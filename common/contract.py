"""The task contract: what the producer sends and what a worker hands back, nothing else.

Bump ``CONTRACT_VERSION`` on any incompatible change: a worker refuses payloads of another version
instead of misreading them.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

CONTRACT_VERSION = 1
TASK_NAME = "specfleet.generate"
#: The queue a worker listens on before any dataset is active; nothing is ever sent to it.
IDLE_QUEUE = "specfleet.idle"


class TaskPayload(TypedDict):
    v: int
    #: Run-config id: workers fetch ``keys.config(run)`` once per process and cache it.
    run: str
    dataset: str
    id: str
    #: ``file:line`` of the prompt, so every failure can name where it came from.
    where: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost: float


class ResultRow(TypedDict):
    """One output row, as it travels (msgpack) through the results stream and lands in a shard."""

    id: str
    conversations: list[dict[str, Any]]
    input_ids: list[int]
    loss_mask: list[int]
    #: Tokens the budget counted: sum(loss_mask).
    num_tokens: int
    finish_reason: str
    reasoning_end: str
    usage: Usage
    provider: str
    model: str
    generation_id: str
    attempts: int
    where: NotRequired[str]
    #: The row's tool declarations, when the prompt had them (they are part of the prompt ids).
    tools: NotRequired[list[dict[str, Any]]]


# Failure reasons written to failed.jsonl (stable words for reports and metrics).
FAIL_UPSTREAM_FATAL = "upstream_fatal"
FAIL_RETRIES_EXHAUSTED = "retries_exhausted"
FAIL_TOKEN_MISMATCH = "token_mismatch"
FAIL_INTERNAL = "internal_error"

# Fields of the per-dataset stats hash (keys.DatasetKeys.stats). ``err:<reason>`` counts upstream
# errors by class (``err:http_429`` …), ``fail:<reason>`` final failures.
STAT_BILLED_PROMPT = "billed_prompt_tokens"
STAT_BILLED_COMPLETION = "billed_completion_tokens"
STAT_BILLED_REASONING = "billed_reasoning_tokens"
STAT_COST_MICRO_USD = "cost_micro_usd"
STAT_REQUESTS = "requests"
STAT_DUPLICATES = "duplicates"
STAT_SKIPPED = "skipped"
