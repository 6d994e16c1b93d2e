"""Reading prompt datasets: JSONL in OpenAI form or ShareGPT form, one prompt per line.

OpenAI form:   {"id"?, "messages": [{"role", "content", ...}], "tools"?: [...]}
ShareGPT form: {"id"?, "conversations": [{"from", "value"}], "tools"?: [...]}

The prompt is the conversation up to its last non-assistant message: trailing assistant turns
(the dataset's own answers) are what the target model is asked to produce again. A row without an
id gets a stable content hash, so a re-run recognises it. A bad row raises ``DatasetRowError``
naming ``file:line`` and is counted by the caller; the rest of the file still runs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import DatasetRowError

_ROLES = {"system", "user", "assistant", "tool"}
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}


@dataclass(frozen=True)
class Prompt:
    id: str
    where: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def content_id(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    canonical = json.dumps([messages, tools], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h-" + hashlib.sha256(canonical.encode()).hexdigest()[:20]


def _messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    if "messages" in row:
        raw = row["messages"]
        if not isinstance(raw, list) or not raw:
            raise ValueError("field 'messages': must be a non-empty list")
        out = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise ValueError(f"field 'messages[{i}]': must be an object")
            if m.get("role") not in _ROLES:
                raise ValueError(f"field 'messages[{i}].role': {m.get('role')!r} is not one of {sorted(_ROLES)}")
            content = m.get("content")
            if content is not None and not isinstance(content, str | list):
                raise ValueError(f"field 'messages[{i}].content': must be a string, a list of parts or null")
            out.append(m)
        return out
    if "conversations" in row:
        raw = row["conversations"]
        if not isinstance(raw, list) or not raw:
            raise ValueError("field 'conversations': must be a non-empty list")
        out = []
        for i, turn in enumerate(raw):
            if not isinstance(turn, dict):
                raise ValueError(f"field 'conversations[{i}]': must be an object")
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise ValueError(f"field 'conversations[{i}].from': unknown speaker {turn.get('from')!r}")
            value = turn.get("value")
            if not isinstance(value, str):
                raise ValueError(f"field 'conversations[{i}].value': must be a string")
            out.append({"role": role, "content": value})
        return out
    raise ValueError("no 'messages' (OpenAI form) or 'conversations' (ShareGPT form) field")


def _tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = row.get("tools")
    if tools is None or tools == [] or tools == "":
        return None
    if isinstance(tools, str):  # glaive-style datasets keep the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"field 'tools': string is not JSON ({exc.msg})") from None
    if not isinstance(tools, list):
        raise ValueError("field 'tools': must be a list of tool definitions")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}  # bare function schemas
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ValueError(f"field 'tools[{i}]': expected {{'type': 'function', 'function': {{...}}}}")
        if not tool["function"].get("name"):
            raise ValueError(f"field 'tools[{i}].function.name': missing")
        out.append(tool)
    return out


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetRowError(where, f"not UTF-8 (byte {exc.start})") from None


def parse_row(line: str, where: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetRowError(where, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise DatasetRowError(where, "a row must be a JSON object")
    try:
        messages = _messages(row)
        tools = _tools(row)
    except ValueError as exc:
        raise DatasetRowError(where, str(exc)) from None
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise DatasetRowError(where, "no user message to answer")
    raw_id = row.get("id")
    if raw_id is None or raw_id == "":
        prompt_id = content_id(messages, tools)
    elif isinstance(raw_id, str | int) and not isinstance(raw_id, bool):
        prompt_id = str(raw_id)
    else:
        raise DatasetRowError(where, "field 'id': must be a string or an integer")
    return Prompt(id=prompt_id, where=where, messages=messages, tools=tools)


@dataclass
class ReadStats:
    prompts: int = 0
    malformed: int = 0
    duplicates: int = 0


def read_prompts(
    path: Path, errors: list[DatasetRowError], stats: ReadStats, *, limit: int | None = None
) -> Iterator[Prompt]:
    """Yield the file's good prompts in order; bad rows are appended to ``errors``."""
    seen: dict[str, int] = {}
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if limit is not None and stats.prompts >= limit:
                return
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                prompt = parse_row(_decode(raw, where), where)
            except DatasetRowError as err:
                stats.malformed += 1
                errors.append(err)
                continue
            first = seen.get(prompt.id)
            if first is not None:
                stats.duplicates += 1
                errors.append(DatasetRowError(where, f"duplicate id {prompt.id!r} (first at line {first})"))
                continue
            seen[prompt.id] = lineno
            stats.prompts += 1
            yield prompt
