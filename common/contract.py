"""The task contract: what the producer sends and what a worker hands back, nothing else.

Bump ``CONTRACT_VERSION`` on any incompatible change: a worker refuses payloads of another version
instead of misreading them.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

from common.endpoints import ACCEPTED_FORMS

#: 3: the producer seals every prompt it enqueues (``seal``: an HMAC of its id, common/seal.py) and a
#: worker runs only those (``workers/fleet/poison.py``). Version 2 recorded every id in a SET that grew
#: with the dataset; its messages carry no seal, so they are refused by their version.
CONTRACT_VERSION = 3
TASK_NAME = "specfleet.generate"
#: The queue a worker listens on before any dataset is active; nothing is ever sent to it.
IDLE_QUEUE = "specfleet.idle"
#: The remote-control command the producer broadcasts when the active queues change: workers
#: follow them at once instead of at their next ``SPECFLEET_QUEUE_POLL_S`` poll.
FOLLOW_COMMAND = "specfleet_follow"


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
    #: ``common.seal.seal`` of the id under the dataset's key, added by ``producer/enqueue.push``: a
    #: worker refuses a payload without the right one (``unknown_id``).
    seal: NotRequired[str]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost: float
    #: 1 when the answer was cut by max_tokens (``finish_reason = "length"``): counted with the
    #: billed answer's usage (the ``truncated`` counter), never written to a row.
    truncated: NotRequired[int]


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
    #: Rows whose ids came from the engine: the text rebuild checked against them
    #: (``{"match", "prompt_match", …}``, see ``workers/pipeline/engine_ids.py``).
    engine_check: NotRequired[dict[str, Any]]
    #: The billed usage against the fleet's own counts (``common/usage_check.py``): ``{"match",
    #: "prompt_diff", "completion_diff"}`` (billed minus counted), and ``expected`` when it disagreed.
    #: Absent: not compared (``usage_check = "off"``, or no usage billed).
    usage_check: NotRequired[dict[str, Any]]
    #: The run manifest's id (``common/manifest.py``, ``OUT/manifest.json``) the row belongs to.
    manifest: NotRequired[str]
    #: The quantization its provider serves the model at, from the endpoints API (absent: unknown).
    quantization: NotRequired[str]
    #: regenerate = "all": the turn's index in its conversation (``id`` is the conversation's), the
    #: row's own key ``<id>#<turn>`` (the exactly-once guard's member), and on a conversation's last
    #: row why it ended there (``CONVERSATION_ENDS``).
    turn: NotRequired[int]
    key: NotRequired[str]
    conversation_end: NotRequired[str]
    #: ``[[datasets]] sampling``: the recipe the prompt was asked with, ``{"recipe": name, <params>}``
    #: (common/sampling.py).
    sampling: NotRequired[dict[str, Any]]
    #: A degenerate answer's mark, ``{"degenerate": reason, …}`` (common/quality.py); absent: none.
    quality: NotRequired[dict[str, Any]]


#: Why a regenerated conversation ended at a turn: its last assistant turn was produced; the turn
#: called tools (the dataset's tool results answered other calls); the dataset goes on with tool
#: results although the regenerated turn called no tool; the turn was cut before its end
#: (``finish_reason`` length or a filter: as history it would read as a turn the model finished).
CONVERSATION_ENDS = ("last_turn", "tool_calls", "tool_results", "cut")


def row_key(conversation_id: str, turn: int) -> str:
    """A regenerated turn's key: what the budget's done set, leases and failures name."""
    return f"{conversation_id}#{turn}"


def conversation_of(key: str) -> str:
    """The conversation id of a row key (``row_key``'s inverse; ids may contain '#')."""
    return key.rsplit("#", 1)[0]


# Failure reasons written to failed.jsonl (stable words for reports and metrics).
FAIL_UPSTREAM_FATAL = "upstream_fatal"
FAIL_RETRIES_EXHAUSTED = "retries_exhausted"
#: Every attempt met a "wrong URL or model" answer, yet too few prompts did to halt the fleet.
FAIL_MISCONFIGURED = "misconfigured"
FAIL_TOKEN_MISMATCH = "token_mismatch"
#: Refused before any request: the prompt is over the length class's or the model's limit.
FAIL_PROMPT_TOO_LONG = "prompt_too_long"
FAIL_INTERNAL = "internal_error"
#: The answer's body was over SPECFLEET_MAX_ANSWER_BYTES: billed and counted, not kept.
FAIL_ANSWER_TOO_LARGE = "answer_too_large"
#: Batch mode: the batch's result for the prompt was an error (the next run asks it again).
FAIL_BATCH_ERROR = "batch_error"
#: Batch mode: the Batch API refused the prompt's request (its whole batch failed validation naming it,
#: or refused the submission with a 4xx).
FAIL_BATCH_INVALID = "batch_invalid"
#: ``[request] providers = "pin"``: the answer came from another provider than the pinned one
#: (billed and counted, not kept).
FAIL_PROVIDER_REFUSED = "provider_refused"
#: One request's worst case (prompt + max_tokens at the model's price) is over the account's whole
#: balance (402 weight_exceeds_budget): no retry can help; lower max_tokens or add credits.
FAIL_WEIGHT_EXCEEDS_BUDGET = "weight_exceeds_budget"
#: The account refused the prompt for its in-flight budget (402 in_flight_budget_exhausted) again and
#: again for ``[retry] in_flight_wait_max_s``: the balance stayed held (the next run asks it again).
FAIL_IN_FLIGHT_BUDGET = "in_flight_budget_exhausted"

# The per-dataset stats hash's fields are named in common/stats.py only.

#: Halt reasons (``keys.HALT``'s ``reason``) other than the refused account's ``http_401``/``http_402``.
HALT_MISCONFIGURED = "misconfigured"
#: An engine run that cannot go on (no ids, another chat template): the message ends with the
#: engine's own fix (``halt_message``), which the halt line keeps as its end.
HALT_ENGINE = "engine"
#: Past ``usage_mismatch_max`` of the first answers were billed other token counts than the run's
#: tokenizer gives (``common/usage_check.py``): the rows' ids are not the model's.
HALT_USAGE = "usage_mismatch"
#: What ``keys.HALT`` keeps of a halt's message (``Budget.halt``).
HALT_MESSAGE_MAX_CHARS = 300


def halt_message(what: str, fix: str) -> str:
    """``what; fix`` within HALT_MESSAGE_MAX_CHARS, ``what`` cut short rather than the fix."""
    room = HALT_MESSAGE_MAX_CHARS - len(fix) - 2
    if len(what) > room:
        what = what[:max(room - 1, 0)] + "…"
    return f"{what}; {fix}"[:HALT_MESSAGE_MAX_CHARS]


def halt_line(reason: str, message: str) -> str:
    """What the producer tells the user about a halt a worker recorded: once, with what to fix."""
    if reason == HALT_ENGINE:
        return f"the engine run was halted (run the same command again once fixed): {message}"
    if reason == HALT_USAGE:
        return f"the run was halted: the rows' token ids are not what the model was billed for: {message}"
    if reason == HALT_MISCONFIGURED:
        # The message names the URL tried (MisconfiguredError.target); the forms a base URL may take
        # are said here, unbounded by what keys.HALT keeps of the message.
        return (f"the upstream is misconfigured: {message.rstrip('.')}; fix the workers' OPENROUTER_BASE_URL "
                f"(SPECFLEET_ENGINE_URL for an engine run; accepted: {ACCEPTED_FORMS}) or the run file's "
                "model.name, then run the same command again to resume")
    return (f"OpenRouter refused the account ({reason}: {message}); fix the key or the credits, then run "
            "the same command again to resume")
