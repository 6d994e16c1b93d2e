"""``#sim`` scripted answers: a test writes the answer it wants into the prompt itself.

The last user message's text starts with ``#sim `` and a JSON object; anything after the object is
free text (use it to make prompts distinct). The format is documented in ``simulator/__init__.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from simulator.faults import fault_name
from simulator.kimi import message_text
from simulator.request import BadRequest
from simulator.settings import REASONING_FIELDS

#: Where an engine answer carries its ids (``#sim`` ``ids_shape``): ``vllm`` prompt ids at the top
#: level and the sampled ids in the choice (also SGLang builds patched that way); ``sglang`` both in
#: the choice (SGLang's ``ChatCompletionResponseChoice``); ``none`` no ids (an engine that ignores
#: ``return_token_ids``, as stock servers before it did).
ID_SHAPES = ("vllm", "sglang", "none")

PREFIX = "#sim "
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter", "error")
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cached_tokens", "cost")


@dataclass(frozen=True)
class ScriptedCall:
    name: str
    arguments: str
    id: str | None = None  # default functions.{name}:{idx}


@dataclass(frozen=True)
class Script:
    given: frozenset[str]  # keys present in the JSON: absent ones are generated as usual
    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[ScriptedCall, ...] = ()
    raw_tool_text: bool = False
    finish_reason: str | None = None
    native_finish_reason: str | None = None
    reasoning_field: str | None = None
    leak_im_end: bool = False
    fail_attempts: tuple[str, ...] = ()
    latency_ms: float | None = None
    retry_after_s: float | None = None
    provider: str | None = None
    usage: Mapping[str, float] = field(default_factory=dict)
    noncanonical: bool = False  # engine-ids mode: inject a non-canonical tokenization
    #: completion tokens billed beyond the answer's own (the usage fault), whatever usage_skew_rate says
    usage_skew: int = 0
    #: engine-ids mode: where the answer carries the ids (``ID_SHAPES``; None: vllm's places).
    ids_shape: str | None = None


def find_script(messages: Sequence[Mapping[str, Any]]) -> Script | None:
    """The script in the last user message, or None. A malformed script is a 400, so a typo in a
    test fails loudly instead of silently getting a generated answer."""
    last_user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
    if last_user is None:
        return None
    text = message_text(last_user.get("content"))
    if not text.startswith(PREFIX):
        return None
    try:
        spec, _ = json.JSONDecoder().raw_decode(text, len(PREFIX))
    except ValueError as exc:
        raise BadRequest(f"#sim: not a JSON object: {exc}") from None
    if not isinstance(spec, dict):
        raise BadRequest("#sim: expected a JSON object")
    return _parse(spec)


_KEYS = frozenset({
    "reasoning", "content", "tool_calls", "raw_tool_text", "finish_reason",
    "native_finish_reason", "reasoning_field", "leak_im_end", "fail_attempts", "latency_ms",
    "retry_after_s", "provider", "usage", "noncanonical", "ids_shape", "usage_skew",
})


def _parse(spec: Mapping[str, Any]) -> Script:
    unknown = set(spec) - _KEYS
    if unknown:
        raise BadRequest(f"#sim: unknown key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
    return Script(
        given=frozenset(spec),
        reasoning=_opt_str(spec, "reasoning"),
        content=_opt_str(spec, "content"),
        tool_calls=_calls(spec.get("tool_calls") or []),
        raw_tool_text=_bool(spec, "raw_tool_text"),
        finish_reason=_choice(spec, "finish_reason", FINISH_REASONS),
        native_finish_reason=_opt_str(spec, "native_finish_reason"),
        reasoning_field=_choice(spec, "reasoning_field", REASONING_FIELDS),
        leak_im_end=_bool(spec, "leak_im_end"),
        fail_attempts=_fail_attempts(spec.get("fail_attempts") or []),
        latency_ms=_opt_number(spec, "latency_ms"),
        retry_after_s=_opt_number(spec, "retry_after_s"),
        provider=_opt_str(spec, "provider"),
        usage=_usage(spec.get("usage") or {}),
        noncanonical=_bool(spec, "noncanonical"),
        ids_shape=_choice(spec, "ids_shape", ID_SHAPES),
        usage_skew=_int(spec, "usage_skew"),
    )


def _int(spec: Mapping[str, Any], key: str) -> int:
    value = spec.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"#sim.{key}: expected an integer")
    return value


def _opt_str(spec: Mapping[str, Any], key: str) -> str | None:
    value = spec.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"#sim.{key}: expected a string or null")
    return value


def _bool(spec: Mapping[str, Any], key: str) -> bool:
    value = spec.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"#sim.{key}: expected true or false")
    return value


def _choice(spec: Mapping[str, Any], key: str, choices: Sequence[str]) -> str | None:
    value = spec.get(key)
    if value is not None and value not in choices:
        raise BadRequest(f"#sim.{key}: expected one of {', '.join(choices)}")
    return value


def _opt_number(spec: Mapping[str, Any], key: str) -> float | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise BadRequest(f"#sim.{key}: expected a non-negative number")
    return float(value)


def _calls(raw: Any) -> tuple[ScriptedCall, ...]:
    if not isinstance(raw, list):
        raise BadRequest("#sim.tool_calls: expected a list")
    calls = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise BadRequest(f"#sim.tool_calls[{i}]: expected an object")
        fn = item.get("function")
        if not isinstance(fn, dict):
            fn = item
        name, args = fn.get("name"), fn.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise BadRequest(f"#sim.tool_calls[{i}].name: expected a string")
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call_id = item.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise BadRequest(f"#sim.tool_calls[{i}].id: expected a string")
        calls.append(ScriptedCall(name=name, arguments=text, id=call_id))
    return tuple(calls)


def _fail_attempts(raw: Any) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise BadRequest("#sim.fail_attempts: expected a list")
    try:
        return tuple(fault_name(entry) for entry in raw)
    except ValueError as exc:
        raise BadRequest(f"#sim.fail_attempts: {exc}") from None


def _usage(raw: Any) -> Mapping[str, float]:
    if not isinstance(raw, dict):
        raise BadRequest("#sim.usage: expected an object")
    for key, value in raw.items():
        if key not in USAGE_KEYS:
            raise BadRequest(f"#sim.usage.{key}: unknown (known: {', '.join(USAGE_KEYS)})")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise BadRequest(f"#sim.usage.{key}: expected a non-negative number")
    return dict(raw)
