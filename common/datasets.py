"""Reading prompt datasets, streamed, in OpenAI form or ShareGPT form, one prompt per row.

A dataset's ``path`` is JSONL (one row per line), gzip or zstd JSONL (``.jsonl.gz``, ``.jsonl.zst``),
a Parquet file, a folder or glob of Parquet shards (or of JSONL files), or a folder written by
``datasets``' ``save_to_disk`` (its arrow files, memory-mapped). Every format is read a batch at a
time, never whole; every reader goes through ``read_prompts`` (``dataset_sources`` lists the files).
A bad JSONL row is named ``file:line``; a bad Parquet or arrow row ``file:row N`` (N from 0, as
``ds[N]`` counts). A columnar file gives every row every column, so a null field there is read as an
absent one: the same data in JSONL and in Parquet give the same prompts and the same content ids.

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

import glob
import gzip
import hashlib
import io
import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import orjson

from common.errors import DatasetFieldError, DatasetPathError, DatasetRowError

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
            raise DatasetFieldError("field 'messages': must be a non-empty list")
        out = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise DatasetFieldError(f"field 'messages[{i}]': must be an object")
            if m.get("role") not in _ROLES:
                raise DatasetFieldError(f"field 'messages[{i}].role': {m.get('role')!r} is not one of {sorted(_ROLES)}")
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
            raise DatasetFieldError("field 'conversations': must be a non-empty list")
        out = []
        for i, turn in enumerate(raw):
            if not isinstance(turn, dict):
                raise DatasetFieldError(f"field 'conversations[{i}]': must be an object")
            role = _SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise DatasetFieldError(f"field 'conversations[{i}].from': unknown speaker {turn.get('from')!r}")
            value = turn.get("value")
            if not isinstance(value, str):
                raise DatasetFieldError(f"field 'conversations[{i}].value': must be a string")
            out.append({"role": role, "content": value})
        return out
    raise DatasetFieldError("no 'messages' (OpenAI form) or 'conversations' (ShareGPT form) field")


def _joined_text(content: Any, field: str) -> str:
    """OpenAI text parts as one string; anything else is the row's error, named by field."""
    if not isinstance(content, list):
        raise DatasetFieldError(f"{field}: must be a string, a list of text parts or null, "
                                f"not {type(content).__name__}")
    if not content:
        raise DatasetFieldError(f"{field}: an empty list of parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise DatasetFieldError(f"{field}[{j}]: a part must be an object like {{'type': 'text', 'text': ...}}, "
                                    f"not {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise DatasetFieldError(f"{field}[{j}].type: {kind!r} parts are not supported (text models: 'text' only)")
        if not isinstance(part.get("text"), str):
            raise DatasetFieldError(f"{field}[{j}].text: must be a string")
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
            raise DatasetFieldError(f"field 'tools': string is not JSON ({exc.msg})") from None
    if not isinstance(tools, list):
        raise DatasetFieldError("field 'tools': must be a list of tool definitions")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}  # bare function schemas
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise DatasetFieldError(f"field 'tools[{i}]': expected {{'type': 'function', 'function': {{...}}}}")
        if not tool["function"].get("name"):
            raise DatasetFieldError(f"field 'tools[{i}].function.name': missing")
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
    return parse_object(row, where)


def parse_object(row: Any, where: str) -> Prompt:
    """A row already decoded (a JSON line's object, a Parquet or arrow row) as a prompt."""
    if not isinstance(row, dict):
        raise DatasetRowError(where, "a row must be a JSON object")
    try:
        messages = _messages(row)
        tools = _tools(row)
    except DatasetFieldError as exc:
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
    #: Good prompts not asked: the same prompt (normalised) as an earlier one of the run, and
    #: prompts sharing an n-gram run with an eval set (``common/prompt_filter.py``).
    duplicate_prompts: int = 0
    excluded: int = 0


class Screen(Protocol):
    """What one read of a dataset leaves out before paying (``common/prompt_filter.DatasetScreen``)."""

    def skip(self, prompt: Prompt, stats: ReadStats) -> bool: ...

    def done(self) -> None: ...


class SeenIds:
    """The ids read so far, for refusing a second row with the same id, as 64-bit fingerprints in
    one open-addressed ``array('Q')``: 11-23 bytes per id (load 0.35-0.7), against ~120 for a dict
    of the id strings. Exactly-once needs it: two rows under one id would be one prompt to the
    done-set, so the second must be refused as the file is read (the window reads it as a stream,
    and a sweep or top-up round reads it again: each read refuses the same rows). Two different ids
    share a fingerprint with odds ~n²/2⁶⁵ (3e-6 at 10M ids): that row would be refused as a
    duplicate, never written twice."""

    _MAX_LOAD = 0.7

    def __init__(self) -> None:
        self._slots = array("Q", bytes(8 * 1024))
        self._used = 0

    @staticmethod
    def _fingerprint(prompt_id: str) -> int:
        return int.from_bytes(hashlib.blake2b(prompt_id.encode(), digest_size=8).digest(), "little") or 1

    def add(self, prompt_id: str) -> bool:
        """Record ``prompt_id``; False when it was already there."""
        fp = self._fingerprint(prompt_id)
        slots = self._slots
        mask = len(slots) - 1
        i = fp & mask
        while True:
            held = slots[i]
            if held == fp:
                return False
            if not held:
                break
            i = (i + 1) & mask
        slots[i] = fp
        self._used += 1
        if self._used > self._MAX_LOAD * len(slots):
            self._grow()
        return True

    def _grow(self) -> None:
        old = self._slots
        slots = self._slots = array("Q", bytes(16 * len(old)))
        mask = len(slots) - 1
        for fp in old:
            if fp:
                i = fp & mask
                while slots[i]:
                    i = (i + 1) & mask
                slots[i] = fp

    @property
    def bytes(self) -> int:
        return self._slots.itemsize * len(self._slots)


#: What a ``path`` is read as: one kind per file (``dataset_sources``).
JSONL, PARQUET, ARROW = "jsonl", "parquet", "arrow"
_GLOB_CHARS = set("*?[")
#: Rows decoded from a columnar file at once: the memory of one batch, whatever the file's size.
_COLUMNAR_BATCH_ROWS = 256


def _kind_of(file: Path) -> str:
    return PARQUET if file.name.endswith(".parquet") else JSONL


def _arrow_files(folder: Path) -> list[Path]:
    """A ``save_to_disk`` folder's arrow files in their order (its ``state.json``)."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if len(splits) != 1:
            raise DatasetPathError(f"{folder}: a saved DatasetDict with splits {splits}: set path to one "
                                   f"split's folder (e.g. {folder / (splits[0] if splits else 'train')})")
        folder = folder / splits[0]
    state = json.loads((folder / "state.json").read_text())
    return [folder / f["filename"] for f in state.get("_data_files", [])]


def dataset_sources(path: Path) -> list[tuple[str, Path]]:
    """The files ``path`` names, each with its kind, in reading order; ``DatasetPathError`` when none."""
    if _GLOB_CHARS & set(path.name):
        files = [Path(f) for f in sorted(glob.glob(str(path))) if Path(f).is_file()]
        if not files:
            raise DatasetPathError(f"{path}: no file matches")
        return [(_kind_of(f), f) for f in files]
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return [(ARROW, f) for f in _arrow_files(path)]
        shards = sorted(path.rglob("*.parquet"))
        if not shards:
            raise DatasetPathError(f"{path}: a folder with no .parquet files and no save_to_disk state.json")
        return [(PARQUET, f) for f in shards]
    if not path.is_file():
        raise DatasetPathError(f"{path}: no such file")
    return [(_kind_of(path), path)]


def dataset_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a dataset, or None."""
    try:
        sources = dataset_sources(path)
        for kind, file in sources:
            if kind == JSONL and _starts_an_array(file):
                lines = f"{file.stem}.jsonl" if file.suffix == ".json" else f"{file.stem}-lines.jsonl"
                return (f"{file}: a JSON array, not JSONL (one JSON object per line): convert it with "
                        f"jq -c '.[]' {file.name} > {lines}")
    except (DatasetPathError, OSError, ValueError) as exc:
        return str(exc)
    return None


def _starts_an_array(file: Path) -> bool:
    """A JSON array (``[{…}, …]``) where JSONL was expected: every line would be malformed."""
    with open_jsonl(file) as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def open_jsonl(path: Path) -> BinaryIO:
    """A JSONL file's bytes, decompressed as it is read for ``.gz`` and ``.zst``."""
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if path.name.endswith(".zst"):
        import zstandard

        raw = path.open("rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return path.open("rb")


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


def _without_nulls(value: Any) -> Any:
    """A columnar row as its JSON line would be: a struct column gives every row every key of every
    row, null where the row had none (a tool's schema properties, a message's ``tool_calls``)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _columnar_rows(kind: str, file: Path, first_row: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """A Parquet file's or an arrow file's rows, a batch at a time (``file:row N``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == PARQUET:
        batches: Iterator[Any] = pq.ParquetFile(file).iter_batches(batch_size=_COLUMNAR_BATCH_ROWS)
    else:  # datasets writes the arrow stream format; memory-mapped, so a batch costs only its rows
        batches = iter(pa.ipc.open_stream(pa.memory_map(str(file))))
    n = first_row
    for batch in batches:
        for start in range(0, batch.num_rows, _COLUMNAR_BATCH_ROWS):
            for row in batch.slice(start, _COLUMNAR_BATCH_ROWS).to_pylist():
                yield f"{file}:row {n}", _without_nulls(row)
                n += 1


def _items(path: Path, max_line_bytes: int) -> Iterator[tuple[str, int, Any]]:
    """Every row of the dataset as (where, size in bytes, row), the row a JSON line's bytes, a decoded
    columnar row, or a ``DatasetRowError`` (blank lines left out). A save_to_disk folder counts its
    rows across its files, as ``ds[N]`` does; Parquet shards each from 0."""
    arrow_rows = 0  # a saved folder's rows count on across its files
    for kind, file in dataset_sources(path):
        if kind == JSONL:
            with open_jsonl(file) as fh:
                for lineno, (raw, size) in enumerate(_lines(fh, max_line_bytes), start=1):
                    where = f"{file}:{lineno}"
                    if raw is None:
                        yield where, size, DatasetRowError(
                            where, f"line_too_long ({size:,} bytes > {max_line_bytes:,})")
                    elif raw.strip():
                        yield where, size, raw
            continue
        for where, row in _columnar_rows(kind, file, arrow_rows if kind == ARROW else 0):
            arrow_rows += kind == ARROW
            size = len(orjson.dumps(row))
            if size > max_line_bytes:
                yield where, size, DatasetRowError(where, f"row_too_long ({size:,} bytes as JSON > {max_line_bytes:,})")
            else:
                yield where, size, row


def row_sizes(path: Path, max_line_bytes: int) -> Iterator[int]:
    """Each row's size in bytes, as a JSON line (what the plan's byte bounds read), without parsing
    JSONL; over-limit rows included (their size is past ``max_line_bytes``)."""
    for _, size, _ in _items(path, max_line_bytes):
        yield size


def is_plain_jsonl(path: Path) -> bool:
    """One uncompressed JSONL file: the plan's fast byte scan reads it as raw bytes."""
    return path.is_file() and _kind_of(path) == JSONL and not path.name.endswith((".gz", ".zst"))


def read_prompts(
    path: Path,
    errors: list[DatasetRowError],
    stats: ReadStats,
    *,
    limit: int | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    screen: Screen | None = None,
) -> Iterator[Prompt]:
    """Yield the dataset's good prompts in order; bad rows are appended to ``errors``. ``screen``:
    the run's duplicates and eval leaks, left out here, so the plan and every read of the run agree
    (``max_prompts`` counts the prompts asked); told ``done`` when the read reaches its end."""
    seen = SeenIds()
    for where, _, item in _items(path, max_line_bytes):
        if limit is not None and stats.prompts >= limit:
            if screen is not None:
                screen.done()
            return
        try:
            if isinstance(item, DatasetRowError):
                raise item
            prompt = parse_row(_decode(item, where), where) if isinstance(item, bytes) else parse_object(item, where)
        except DatasetRowError as err:
            stats.malformed += 1
            errors.append(err)
            continue
        if not seen.add(prompt.id):
            stats.duplicates += 1
            errors.append(DatasetRowError(where, f"duplicate id {prompt.id!r} (an earlier row has it)"))
            continue
        if screen is not None and screen.skip(prompt, stats):
            continue
        stats.prompts += 1
        yield prompt
    if screen is not None:
        screen.done()
