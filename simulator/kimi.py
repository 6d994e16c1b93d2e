"""Kimi K2/K2.5 special-token text forms, and the renders the simulator counts tokens on.

See shared/reference/target-tokens.md. The renders are close to the chat template, not exact: they
only feed usage counts, which real providers do not match to the client's own count either.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IM_END = "<|im_end|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_SYSTEM = "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
THINK = "<think>"
THINK_END = "</think>"

SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]", "[EOS]", IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE,
    TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END,
    THINK, THINK_END, "[UNK]", "[PAD]",
)


@dataclass(frozen=True)
class ToolCall:
    id: str  # functions.{name}:{idx}, idx counting calls across the conversation
    name: str
    arguments: str  # JSON text, as the model emitted it


def message_text(content: object) -> str:
    """Text of an OpenAI message ``content``: a string, a list of parts, or null."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping)
        )
    return ""


def render_tool_calls(calls: Sequence[ToolCall]) -> str:
    """The tool-call section exactly as Kimi emits it (no whitespace between pieces)."""
    if not calls:
        return ""
    body = "".join(
        f"{TOOL_CALL_BEGIN}{c.id}{TOOL_CALL_ARGUMENT_BEGIN}{c.arguments}{TOOL_CALL_END}"
        for c in calls
    )
    return f"{TOOL_CALLS_BEGIN}{body}{TOOL_CALLS_END}"


def calls_in_message(message: Mapping[str, Any]) -> list[ToolCall]:
    """Structured tool calls of an assistant message in the request history."""
    out: list[ToolCall] = []
    for raw in message.get("tool_calls") or ():
        if not isinstance(raw, Mapping):
            continue
        fn = raw.get("function")
        if not isinstance(fn, Mapping):
            fn = {}
        args = fn.get("arguments", "")
        out.append(ToolCall(
            id=str(raw.get("id", "")),
            name=str(fn.get("name", "")),
            arguments=args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        ))
    return out


def render_prompt(messages: Iterable[Mapping[str, Any]], tools: Sequence[Any]) -> str:
    """The prompt as K2.5 sees it, ending with the generation prompt (which opens ``<think>``)."""
    parts: list[str] = []
    if tools:
        declared = json.dumps(list(tools), ensure_ascii=False)
        parts.append(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{declared}{IM_END}")
    for m in messages:
        role = str(m.get("role", "user"))
        text = message_text(m.get("content"))
        if role == "tool":
            name = m.get("name") or "tool"
            ret = f"## Return of {m.get('tool_call_id', '')}\n{text}"
            parts.append(f"{IM_SYSTEM}{name}{IM_MIDDLE}{ret}{IM_END}")
        elif role == "assistant":
            # History turns lose their reasoning in the template: an empty think block remains.
            section = render_tool_calls(calls_in_message(m))
            parts.append(
                f"{IM_ASSISTANT}{m.get('name') or 'assistant'}{IM_MIDDLE}"
                f"{THINK}{THINK_END}{text}{section}{IM_END}"
            )
        else:
            tag = IM_USER if role == "user" else IM_SYSTEM
            parts.append(f"{tag}{m.get('name') or role}{IM_MIDDLE}{text}{IM_END}")
    parts.append(f"{IM_ASSISTANT}assistant{IM_MIDDLE}{THINK}")
    return "".join(parts)
