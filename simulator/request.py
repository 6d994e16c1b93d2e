"""Reading and validating a chat-completions request body (the OpenRouter fields that matter)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simulator.seeding import prompt_hash

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
EFFORTS = frozenset({"xhigh", "high", "medium", "low", "minimal", "none"})


class BadRequest(ValueError):
    """The body is not a valid request: answered 400 with this message."""


@dataclass(frozen=True)
class ReasoningMode:
    enabled: bool = True  # Kimi K2.5 reasons unless told not to
    exclude: bool = False  # reasoned and billed, but not returned
    effort: str | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tool_choice: Any
    max_tokens: int | None
    stream: bool
    reasoning: ReasoningMode
    prompt_hash: str
    #: vLLM's switch (engine_ids.py): answer with prompt_token_ids and each choice's token_ids
    return_token_ids: bool = False
    #: OpenRouter's ``provider`` preferences (only, ignore, order, allow_fallbacks …: providers.py)
    provider: dict[str, Any] | None = None


def parse_chat_request(raw: bytes, *, default_model: str) -> ChatRequest:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}]: expected an object with a valid role")
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise BadRequest("model: expected a string")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=_tools(body.get("tools")),
        tool_choice=body.get("tool_choice", "auto"),
        max_tokens=_max_tokens(body),
        stream=_flag(body, "stream"),
        reasoning=_reasoning(body),
        prompt_hash=prompt_hash(messages),
        return_token_ids=_flag(body, "return_token_ids"),
        provider=_provider(body.get("provider")),
    )


def _provider(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("provider: expected an object")
    for key in ("only", "ignore", "order", "quantizations"):
        names = value.get(key)
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise BadRequest(f"provider.{key}: expected a list of strings")
    return value


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key}: expected true or false")
    return value


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{where}: expected a positive integer")
    return value


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            return _positive_int(body[key], key)
    return None


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise BadRequest("tools: expected a list")
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}]: expected {{type: function, function: {{name, …}}}}")
    return raw


def _reasoning(body: Mapping[str, Any]) -> ReasoningMode:
    raw = body.get("reasoning")
    if raw is None:
        # Legacy switch: include_reasoning=false hides reasoning; the model still reasons.
        include = body.get("include_reasoning")
        return ReasoningMode(exclude=include is False)
    if not isinstance(raw, dict):
        raise BadRequest("reasoning: expected an object")
    effort = raw.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise BadRequest(f"reasoning.effort: expected one of {', '.join(sorted(EFFORTS))}")
    max_tokens = raw.get("max_tokens")
    if max_tokens is not None:
        max_tokens = _positive_int(max_tokens, "reasoning.max_tokens")
    enabled = raw.get("enabled", True) is not False and effort != "none"
    return ReasoningMode(
        enabled=enabled, exclude=raw.get("exclude") is True, effort=effort, max_tokens=max_tokens
    )
