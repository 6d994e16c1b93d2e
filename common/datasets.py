"""Reading prompt datasets: JSONL in OpenAI form or ShareGPT form, one prompt per line.

OpenAI form:   {"id"?, "messages": [{"role", "content", ...}], "tools"?: [...]}
ShareGPT form: {"id"?, "conversations": [{"from", "value"}], "tools"?: [...]}

The prompt is the conversation up to its last non-assistant message: trailing assistant turns
(the dataset's own answers) are what the target model is asked to produce again. A row without an
id gets a stable content hash, so a re-run recognises it. A bad row raises ``DatasetRowError``
naming ``file:line`` and is counted by the caller; the rest of the file still runs.

A UTF-8 BOM before a row is dropped. ``content`` is a string, null (a tool-calling
assistant turn; read as "") or OpenAI text parts (``[{"type": "text", "text": …}, …]``), which are joined into
one string with nothing between them: that is what Kimi's chat template renders for parts, and a
string is rendered the same way by every template, so the text sent to the model and the text the
worker's template renders for the row never differ. Any other content (numbers, objects, image
parts: the targets are text models) is refused with ``file:line: messages[i].content…``. A line
longer than ``max_line_bytes`` is refused as ``line_too_long`` without being read into memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from common.errors import DatasetRowError

_ROLES = {"system", "user", "assistant", "tool"}
#: The default byte limit of one dataset line (``max_line_bytes`` of a dataset in the run file).
DEFAULT_MAX_LINE_BYTES = 1_000_000
_SKIP_CHUNK_BYTES = 1 << 20
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
            if content is None:
                # A tool-calling turn's null (or missing) content: Qwen3's own template fails on it,
                # and every template renders "" as it renders null. Sent and rendered the same.
                m = {**m, "content": ""}
            elif not isinstance(content, str):
                m = {**m, "content": _joined_text(content, f"messages[{i}].content")}
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


def _joined_text(content: Any, field: str) -> str:
    """OpenAI text parts as one string; anything else is the row's error, named by field."""
    if not isinstance(content, list):
        raise ValueError(f"{field}: must be a string, a list of text parts or null, not {type(content).__name__}")
    if not content:
        raise ValueError(f"{field}: an empty list of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{field}[{j}]: a part must be an object like {{'type': 'text', 'text': ...}}, "
                             f"not {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"{field}[{j}].type: {kind!r} parts are not supported (text models: 'text' only)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{field}[{j}].text: must be a string")
        texts.append(part["text"])
    return "".join(texts)


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
    # Editors on Windows start a file with a BOM; files joined with cat carry one mid-file too.
    line = line.removeprefix("\ufeff")
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


def _lines(fh: BinaryIO, max_line_bytes: int) -> Iterator[tuple[bytes | None, int]]:
    """Each line as (bytes, size), or (None, size) when it is over the limit: an over-limit line is
    skipped in chunks, so a 5 GB line costs one chunk of memory, not 5 GB."""
    while True:
        raw = fh.readline(max_line_bytes + 2)  # room for a "\r\n" ending
        if not raw:
            return
        size = len(raw.rstrip(b"\r\n"))
        if size <= max_line_bytes:
            yield raw, size
            continue
        while not raw.endswith(b"\n"):
            raw = fh.readline(_SKIP_CHUNK_BYTES)
            if not raw:
                break
            size += len(raw.rstrip(b"\r\n"))
        yield None, size


def read_prompts(
    path: Path,
    errors: list[DatasetRowError],
    stats: ReadStats,
    *,
    limit: int | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[Prompt]:
    """Yield the file's good prompts in order; bad rows are appended to ``errors``."""
    seen: dict[str, int] = {}
    with path.open("rb") as fh:
        for lineno, (raw, size) in enumerate(_lines(fh, max_line_bytes), start=1):
            if limit is not None and stats.prompts >= limit:
                return
            where = f"{path}:{lineno}"
            if raw is None:
                stats.malformed += 1
                errors.append(DatasetRowError(where, f"line_too_long ({size:,} bytes > {max_line_bytes:,})"))
                continue
            if not raw.strip():
                continue
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
