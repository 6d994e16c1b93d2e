"""``specfleet validate OUT``: every row of an output folder re-checked offline, no Redis.

A row is rebuilt from what it records, with the code the workers built it with
(``common/target.py``, ``common/rebuild.py``): the prompt is the recorded tokenizer's chat template
rendered with the generation prompt over ``conversations[:-1]`` (and ``tools``), the completion the
assistant turn ``conversations[-1]`` rebuilt with its ``finish_reason``. Then, per row:

- ``id`` (``key`` for ``regenerate = "all"`` rows) once across the dataset's shards and its
  ``truncated.jsonl``;
- ``input_ids`` = the rendered prompt + the rebuilt completion, ``loss_mask`` = 0 over the prompt
  and 1 over the completion, ``num_tokens`` = Σ ``loss_mask``;
- every special-token string in the completion's text is its single id;
- no end-of-turn, EOS or think marker inside ``content`` or ``reasoning_content``;
- against the manifest the row names (``manifest``): the folder has it, its tokenizer files and
  chat template are the tokenizer's here, a ``providers = "pin"`` run holds only the pinned
  provider's rows, ``truncated = "drop"`` no cut row and ``separate`` cut rows only in
  ``truncated.jsonl``; the manifest's own id matches its contents and its counts the rows.

Engine rows (``engine_check``) keep the engine's ids: where the row records that they differ from
the text rebuild, that part is not compared (it is reported in the table instead).

Rows of other tools are read too: SpecForge's ``{id, conversations}`` (the assistant turn rebuilt
and self-checked, markers looked for, ids unique) and speculators' ``{input_ids, loss_mask}``
(shapes, special tokens, no end-of-turn inside a trained span).

Billed usage (``usage``) against each row's own ids: the rows whose billed minus counted tokens
differ from the dataset's most common difference (``common/usage_check.py``'s rule) are counted and
their rate shown, with the rows the fleet flagged as it kept them (``usage_check``); a report, not a
defect (the rows are what the fleet kept, flagged).

Each defect is one ``file:line: reason`` line; a table per dataset follows; exit 1 if any.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError, TokenMismatch
from common.manifest import (
    MANIFEST,
    Manifest,
    chat_template_text,
    identity,
    manifest_id,
    read_manifests,
    resolve_tokenizer,
    template_sha256,
)
from common.quality import is_degenerate
from common.rebuild import ENDED_FINISH_REASONS, rebuild, render_prompt
from common.target import TargetTokenizer
from common.usage_check import differences_disagreeing

#: Files beside the shards that hold no rows (or stubs of rows, not rows).
NOT_ROWS = frozenset({"failed.jsonl", "malformed.jsonl", "dropped.jsonl"})
TRUNCATED_FILE = "truncated.jsonl"
DEGENERATE_FILE = "degenerate.jsonl"
#: ShareGPT speakers → roles (SpecForge and speculators read both spellings).
_SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "system": "system", "tool": "tool"}


@dataclass(frozen=True)
class Defect:
    path: Path
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class DatasetReport:
    name: str
    rows: int = 0
    kept_tokens: int = 0
    truncated: int = 0
    defects: int = 0
    forms: Counter[str] = field(default_factory=Counter)
    providers: Counter[str] = field(default_factory=Counter)
    #: Engine rows whose recorded ids differ from the text rebuild (kept as the engine's: not compared).
    engine_differs: int = 0
    #: Rows with billed usage, and those whose billed minus counted tokens differ from the dataset's
    #: most common difference (common/usage_check.py: a wrong tokenizer or template); and the rows
    #: the fleet flagged as it kept them (``usage_check.match`` false).
    usage_rows: int = 0
    usage_differs: int = 0
    usage_flagged: int = 0
    usage_samples: list[tuple[int, int, bool]] = field(default_factory=list, repr=False)

    @property
    def usage_rate(self) -> str:
        """``usage_differs`` as a share of the rows with usage ("-": none had usage)."""
        return f"{self.usage_differs:,} ({self.usage_differs / self.usage_rows:.2%})" if self.usage_rows else "-"


@dataclass
class _Row:
    path: Path
    line: int
    data: dict[str, Any]


@dataclass
class Validation:
    defects: list[Defect] = field(default_factory=list)
    datasets: list[DatasetReport] = field(default_factory=list)
    manifests: dict[str, Manifest] = field(default_factory=dict)
    tokenizer: str = ""

    @property
    def ok(self) -> bool:
        return not self.defects


# --- finding the rows ---------------------------------------------------------------------------


def dataset_files(out: Path) -> dict[str, list[Path]]:
    """Dataset name → its row files: specfleet's ``OUT/<dataset>/shard-*.jsonl`` (+ truncated.jsonl, degenerate.jsonl),
    else any ``*.jsonl`` in a folder, or one file."""
    if out.is_file():
        return {out.stem: [out]}
    if not out.is_dir():
        raise ConfigError(f"{out}: no such file or folder")
    found: dict[str, list[Path]] = {}
    for sub in sorted(p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")):
        files = sorted(sub.glob("shard-*.jsonl")) + sorted(sub.glob(TRUNCATED_FILE)) + sorted(sub.glob(DEGENERATE_FILE))
        if files:
            found[sub.name] = files
    if not found:
        files = [p for p in sorted(out.glob("*.jsonl")) if p.name not in NOT_ROWS]
        if files:
            found[out.name] = files
    if not found:
        raise ConfigError(f"{out}: no rows found (neither <dataset>/shard-*.jsonl nor *.jsonl)")
    return found


def _read(path: Path, defects: list[Defect]) -> Iterator[_Row]:
    with path.open("rb") as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
            except ValueError as exc:
                defects.append(Defect(path, number, f"not JSON: {exc}"))
                continue
            if not isinstance(data, dict):
                defects.append(Defect(path, number, f"not a JSON object but {type(data).__name__}"))
                continue
            yield _Row(path, number, data)


def row_form(data: dict[str, Any]) -> str:
    """``specfleet`` (both forms in one row), ``specforge`` (conversations only), ``speculators``
    (input_ids and loss_mask only), or ``unknown``."""
    ids = "input_ids" in data and "loss_mask" in data
    if ids and "conversations" in data:
        return "specfleet"
    if "conversations" in data:
        return "specforge"
    return "speculators" if ids else "unknown"


# --- the checks ---------------------------------------------------------------------------------


class Validator:
    def __init__(self, target: TargetTokenizer | None, manifests: dict[str, Manifest],
                 manifest_path: Path = Path(MANIFEST)) -> None:
        self.target = target
        self.manifests = manifests
        self.manifest_path = manifest_path
        self._markers: tuple[str, ...] = ()
        if target is not None:
            fmt = target.turn_format
            self._markers = tuple(dict.fromkeys(
                m for m in (fmt.end_of_turn, target.eos_token, fmt.think_open, fmt.think_close) if m))

    def dataset(self, name: str, files: Sequence[Path]) -> tuple[DatasetReport, list[Defect]]:
        report = DatasetReport(name)
        defects: list[Defect] = []
        seen: dict[str, tuple[Path, int]] = {}
        for path in files:
            for row in _read(path, defects):
                before = len(defects)
                self._row(name, row, report, seen, defects)
                report.defects += len(defects) > before
        report.usage_rows = len(report.usage_samples)
        report.usage_differs = differences_disagreeing(report.usage_samples)
        self._counts(name, report, defects)
        return report, defects

    def _row(self, dataset: str, row: _Row, report: DatasetReport, seen: dict[str, tuple[Path, int]],
             defects: list[Defect]) -> None:
        data = row.data

        def bad(reason: str) -> None:
            defects.append(Defect(row.path, row.line, reason))

        form = row_form(data)
        report.rows += 1
        report.forms[form] += 1
        if form == "unknown":
            bad("neither conversations nor input_ids + loss_mask: not a row")
            return
        key = data.get("key", data.get("id"))
        if key is not None:
            key = str(key)
            if key in seen:
                first_path, first_line = seen[key]
                bad(f"id {key!r} again (first at {first_path}:{first_line})")
            else:
                seen[key] = (row.path, row.line)
        elif form != "speculators":
            bad("no id")
        if data.get("finish_reason") == "length":
            report.truncated += 1
        if "provider" in data:
            report.providers[f"{data.get('provider') or '?'}|{data.get('quantization') or '?'}"] += 1

        if form in ("specfleet", "speculators"):
            ids, mask = data["input_ids"], data["loss_mask"]
            if not _ints(ids) or not _ints(mask):
                bad("input_ids and loss_mask must be lists of integers")
                return
            if len(ids) != len(mask):
                bad(f"input_ids has {len(ids)} tokens, loss_mask {len(mask)}")
                return
            _usage_sample(data, mask, report)
            if any(m not in (0, 1) for m in mask):
                bad("loss_mask holds values other than 0 and 1")
                return
            report.kept_tokens += sum(mask)
            if "num_tokens" in data and data["num_tokens"] != sum(mask):
                bad(f"num_tokens is {data['num_tokens']}, sum(loss_mask) is {sum(mask)}")
        if form == "specfleet":
            self._manifest_checks(dataset, row, bad)
            self._specfleet(row, report, bad)
        elif form == "specforge":
            self._specforge(row, bad)
        else:
            self._speculators(row, bad)

    # --- both conversation forms ---

    def _turns(self, conversations: Any, bad: Any) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """The row's prompt messages and its assistant turn, a leaked special token reported; None
        (reported) when the conversation has no such shape."""
        split = _split_conversation(conversations)
        if isinstance(split, str):
            bad(split)
            return None
        self._leaks(split[1], bad)
        return split

    # --- specfleet rows ---

    def _specfleet(self, row: _Row, report: DatasetReport, bad: Any) -> None:
        data = row.data
        mask: list[int] = data["loss_mask"]
        ids: list[int] = data["input_ids"]
        start = next((i for i, m in enumerate(mask) if m), len(mask))
        if any(m == 0 for m in mask[start:]):
            bad(f"loss_mask is not 0…0 1…1: a 0 at {start + mask[start:].index(0)} "
                f"after the completion began at {start}")
            return
        turns = self._turns(data.get("conversations"), bad)
        if turns is None or self.target is None:
            return
        messages, assistant = turns
        tools = data.get("tools") or None
        try:
            prompt = render_prompt(self.target, messages, tools)
        except Exception as exc:  # a template error on recorded messages is the row's defect
            bad(f"the chat template cannot render the row's prompt: {exc}")
            return
        check = data.get("engine_check") or {}
        engine_prompt_differs = check.get("prompt_match") is False
        engine_completion_differs = check.get("match") is False
        report.engine_differs += engine_prompt_differs or engine_completion_differs
        if not engine_prompt_differs:
            if start != len(prompt.ids):
                bad(f"loss_mask starts at token {start}, the completion at {len(prompt.ids)} "
                    f"(the prompt rendered by the tokenizer and template has {len(prompt.ids)} tokens)")
                return
            at = _first_difference(ids[:start], prompt.ids)
            if at is not None:
                bad(f"prompt ids differ from the chat template's rendering at token {at} "
                    f"({self._tok(ids, at)} vs {self._tok(prompt.ids, at)})")
                return
        completion = ids[start:]
        self._special_ids(completion, bad)
        if engine_completion_differs:
            return
        try:
            rebuilt = rebuild(self.target, messages, tools, _parts(assistant, data), prompt=prompt)
        except TokenMismatch as exc:
            bad(f"the completion cannot be rebuilt from conversations[-1]: {exc}")
            return
        want = rebuilt.input_ids[rebuilt.prompt_tokens:]
        at = _first_difference(completion, want)
        if at is not None:
            bad(f"completion ids differ from the turn rebuilt from conversations[-1] at completion token {at} "
                f"(row {self._tok(completion, at)}, rebuilt {self._tok(want, at)}; "
                f"{len(completion)} vs {len(want)} tokens)")
        elif data.get("reasoning_end") not in (None, rebuilt.reasoning_end):
            bad(f"reasoning_end is {data.get('reasoning_end')!r}, the rebuilt turn's is {rebuilt.reasoning_end!r}")

    def _leaks(self, assistant: dict[str, Any], bad: Any) -> None:
        for key in ("content", "reasoning_content"):
            text = assistant.get(key)
            if not isinstance(text, str):
                continue
            leaked = [m for m in self._markers if m in text]
            if leaked:
                bad(f"conversations[-1].{key} holds {', '.join(map(repr, leaked))} (a marker the turn's tokens "
                    "carry, never its text)")

    def _special_ids(self, completion: list[int], bad: Any) -> None:
        """Every special-token string in the completion's text is its single id (a string the
        tokenizer spelled out in ordinary tokens would train the drafter on its characters)."""
        assert self.target is not None
        target = self.target
        text = target.decode(completion)
        wanted = [target.special_ids_by_string[m.group()] for m in target.specials_in(text)]
        found = [t for t in completion if t in target.special_ids]
        if wanted != found:
            bad(f"special tokens spelled out as text: the completion's text has {len(wanted)} special-token "
                f"string(s), its ids {len(found)} special id(s)")

    def _manifest_checks(self, dataset: str, row: _Row, bad: Any) -> None:
        if not self.manifests:
            return
        data = row.data
        mid = data.get("manifest")
        if mid is None:
            bad(f"no manifest field, the folder has {MANIFEST}")
            return
        manifest = self.manifests.get(str(mid))
        if manifest is None:
            bad(f"manifest {mid!r} is not in this folder (it has {', '.join(sorted(self.manifests))})")
            return
        if manifest.providers_policy == "pin":
            pinned = [str(p) for p in (manifest.provider or {}).get("only") or []]
            provider = str(data.get("provider") or "")
            if not any(_same_provider(provider, p) for p in pinned):
                bad(f"provider {provider!r} under providers = \"pin\" (pinned: {', '.join(pinned) or 'none recorded'})")
        cut = data.get("finish_reason") == "length"
        in_truncated = row.path.name == TRUNCATED_FILE
        policy = manifest.truncated_policy
        if cut and policy == "drop":
            bad('a truncated row (finish_reason "length") kept under truncated = "drop"')
        elif cut and policy == "separate" and not in_truncated:
            bad(f'a truncated row (finish_reason "length") in a shard under truncated = "separate" '
                f"(its place is {TRUNCATED_FILE})")
        elif in_truncated and not cut:
            bad(f'a row in {TRUNCATED_FILE} that was not cut (finish_reason {data.get("finish_reason")!r})')
        # Degenerate rows (``quality``) as [request] degenerate placed them; a cut one set apart as truncated
        # stays in truncated.jsonl (producer/rows.py place_of).
        marked, in_degenerate = is_degenerate(data), row.path.name == DEGENERATE_FILE
        if marked and manifest.degenerate_policy == "drop":
            bad(f'a degenerate row ({data["quality"]["degenerate"]}) kept under degenerate = "drop"')
        elif marked and manifest.degenerate_policy == "separate" and not (in_degenerate or in_truncated):
            bad(f'a degenerate row ({data["quality"]["degenerate"]}) in a shard under degenerate = "separate" '
                f"(its place is {DEGENERATE_FILE})")
        elif in_degenerate and not marked:
            bad(f"a row in {DEGENERATE_FILE} without a degenerate quality mark")

    def _counts(self, dataset: str, report: DatasetReport, defects: list[Defect]) -> None:
        """A one-run folder's manifest counts of this dataset against its rows (once the run wrote
        them: at its end)."""
        if len(self.manifests) != 1 or report.forms["specfleet"] != report.rows:
            return
        prov = next(iter(self.manifests.values())).datasets.get(dataset)
        if prov is None or not prov.providers:
            return
        if Counter(prov.providers) != report.providers:
            defects.append(Defect(self.manifest_path, _line_of(self.manifest_path, f'"{dataset}"'),
                                  f"datasets.{dataset}.providers records {dict(prov.providers)}, "
                                  f"the rows are {dict(report.providers)}"))
            report.defects += 1

    # --- other tools' rows ---

    def _specforge(self, row: _Row, bad: Any) -> None:
        turns = self._turns(row.data["conversations"], bad)
        if turns is None or self.target is None:
            return
        messages, assistant = turns
        try:
            rebuilt = rebuild(self.target, messages, row.data.get("tools") or None, _parts(assistant, row.data))
        except TokenMismatch as exc:
            bad(f"the assistant turn fails the rebuild's self-check: {exc}")
            return
        except Exception as exc:  # a template error on recorded messages is the row's defect
            bad(f"the chat template cannot render the row: {exc}")
            return
        del rebuilt

    def _speculators(self, row: _Row, bad: Any) -> None:
        if self.target is None:
            return
        ids: list[int] = row.data["input_ids"]
        mask: list[int] = row.data["loss_mask"]
        end = self.target.special_ids_by_string.get(self.target.turn_format.end_of_turn)
        for start, stop in _spans(mask):
            span = ids[start:stop]
            self._special_ids(span, bad)
            if end is not None and end in span[:-1]:
                bad(f"an end-of-turn id inside the trained span {start}…{stop - 1} (at {start + span.index(end)})")

    def _tok(self, ids: Sequence[int], i: int) -> str:
        if i >= len(ids):
            return "nothing"
        return f"{self.target.decode([ids[i]])!r} ({ids[i]})" if self.target else str(ids[i])


# --- the manifest against the tokenizer ---------------------------------------------------------


def _line_of(path: Path, needle: str) -> int:
    try:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if needle in line:
                return number
    except OSError:
        pass
    return 1


def check_manifests(out: Path, manifests: dict[str, Manifest], tokenizer_source: str,
                    revision: str | None) -> list[Defect]:
    """Each manifest's id against its contents, and its tokenizer files and template hash against
    the tokenizer this validation renders with."""
    defects: list[Defect] = []
    try:
        folder, here = resolve_tokenizer(tokenizer_source, revision)
    except ConfigError as exc:
        return [Defect(out / MANIFEST, 1, f"cannot hash the tokenizer's files to check the manifest: {exc}")]
    template = template_sha256(chat_template_text(folder))
    for mid, manifest in manifests.items():
        path = out / MANIFEST
        if not path.is_file() or json.loads(path.read_text(encoding="utf-8")).get("manifest_id") != mid:
            path = out / f"manifest-{mid}.json"
        own = manifest_id(identity(manifest.model, manifest.tokenizer, manifest.chat_template_sha256,
                                   manifest.request, manifest.provider, manifest.providers_policy))
        if own != mid:
            defects.append(Defect(path, _line_of(path, '"manifest_id"'),
                                  f"manifest_id {mid} does not match its contents ({own}): the file was edited"))
        for name in sorted(set(manifest.tokenizer.files) | set(here.files)):
            recorded, actual = manifest.tokenizer.files.get(name), here.files.get(name)
            if recorded != actual:
                defects.append(Defect(path, _line_of(path, f'"{name}"'),
                                      f"tokenizer file {name}: recorded sha256 {recorded or 'none'}, "
                                      f"the tokenizer at {folder} has {actual or 'no such file'}"))
        if manifest.chat_template_sha256 != template:
            defects.append(Defect(path, _line_of(path, '"chat_template_sha256"'),
                                  f"chat_template_sha256 recorded {manifest.chat_template_sha256}, "
                                  f"the tokenizer's template is {template}"))
    return defects


# --- entry point --------------------------------------------------------------------------------


def validate(out: Path, *, tokenizer: str | None = None, trust_remote_code: bool = False,
             revision: str | None = None) -> Validation:
    """Validate ``out`` (a folder or one JSONL file). ``tokenizer``: the one to render with; default
    the manifest's. Without a tokenizer or manifest only the shapes and markers are checked."""
    folder = out if out.is_dir() else out.parent
    manifests = read_manifests(folder) if (folder / MANIFEST).is_file() else {}
    result = Validation(manifests=manifests)
    if tokenizer is None and manifests:
        newest = max(manifests.values(), key=lambda m: m.started_at)
        tokenizer, revision = newest.tokenizer.source, newest.tokenizer.revision
    target = None
    if tokenizer is not None:
        target = TargetTokenizer.load(tokenizer, trust_remote_code=trust_remote_code, revision=revision)
        result.tokenizer = tokenizer
        if manifests:
            result.defects += check_manifests(folder, manifests, tokenizer, revision)
    validator = Validator(target, manifests, folder / MANIFEST)
    for name, files in dataset_files(out).items():
        report, defects = validator.dataset(name, files)
        result.datasets.append(report)
        result.defects += defects
    return result


def print_report(result: Validation, *, limit: int = 1000) -> None:
    """The defects (``file:line: reason``, the first ``limit``) then one table row per dataset."""
    from rich.console import Console
    from rich.table import Table

    for defect in result.defects[:limit]:
        print(defect)
    if len(result.defects) > limit:
        print(f"… and {len(result.defects) - limit:,} more defects")
    table = Table(title=f"specfleet validate · tokenizer {result.tokenizer or 'none (shapes and markers only)'}"
                        f" · manifest {', '.join(result.manifests) or 'none'}")
    for col in ("dataset", "rows", "forms", "kept tokens", "truncated", "providers", "engine ids differ",
                "usage differs", "flagged by the fleet", "defective rows"):
        table.add_column(col, justify="left" if col in ("dataset", "forms", "providers") else "right")
    for ds in result.datasets:
        table.add_row(ds.name, f"{ds.rows:,}", ", ".join(f"{k} {v:,}" for k, v in ds.forms.items()),
                      f"{ds.kept_tokens:,}", f"{ds.truncated:,}",
                      ", ".join(f"{k} {v:,}" for k, v in ds.providers.most_common()) or "-",
                      f"{ds.engine_differs:,}", ds.usage_rate, f"{ds.usage_flagged:,}", f"{ds.defects:,}")
    Console(width=200).print(table)
    print(f"{'OK' if result.ok else 'FAILED'}: {sum(d.rows for d in result.datasets):,} rows, "
          f"{len(result.defects):,} defects")


# --- small helpers ------------------------------------------------------------------------------


def _usage_sample(data: dict[str, Any], mask: list[int], report: DatasetReport) -> None:
    """The row's billed minus counted tokens (its prompt: the ids before the loss mask's first 1), if
    it records usage; and the fleet's own flag."""
    usage = data.get("usage")
    check = data.get("usage_check")
    if isinstance(check, dict) and check.get("match") is False:
        report.usage_flagged += 1
    if not isinstance(usage, dict) or not (usage.get("prompt_tokens") or usage.get("completion_tokens")):
        return
    completion = sum(mask)
    prompt = len(mask) - completion
    try:
        p, c = int(usage.get("prompt_tokens") or 0) - prompt, int(usage.get("completion_tokens") or 0) - completion
    except (TypeError, ValueError):
        return
    report.usage_samples.append((p, c, data.get("finish_reason") in ENDED_FINISH_REASONS))


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _spans(mask: Sequence[int]) -> Iterator[tuple[int, int]]:
    start = None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            yield start, i
            start = None


def _same_provider(a: str, b: str) -> bool:
    """OpenRouter names a provider ``DeepInfra`` in answers and ``deepinfra`` in routing."""
    def slug(s: str) -> str:
        return s.strip().lower().replace(" ", "-")
    return slug(a) == slug(b)


def _split_conversation(conversations: Any) -> tuple[list[dict[str, Any]], dict[str, Any]] | str:
    """(prompt messages, the assistant turn) of a row's conversations, ShareGPT spelling read too;
    or why not."""
    if not isinstance(conversations, list) or not conversations:
        return "conversations is not a non-empty list"
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            return f"conversations[{i}] is not an object"
        if "role" not in turn and "from" in turn:
            role = _SPEAKERS.get(str(turn["from"]))
            if role is None:
                return f"conversations[{i}].from: unknown speaker {turn['from']!r}"
            turn = {"role": role, "content": turn.get("value")}
        messages.append(turn)
    if messages[-1].get("role") != "assistant":
        return f"conversations[-1] is a {messages[-1].get('role')!r} turn, not the assistant's"
    return messages[:-1], messages[-1]


@dataclass(frozen=True)
class _Parts:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str


def _parts(assistant: dict[str, Any], row: dict[str, Any]) -> _Parts:
    """The answer's parts as the rebuild takes them, from the turn the row recorded. A turn whose
    reasoning ended implicitly (a tool-call section opened inside it) recorded that section as its
    content: it is handed back as the reasoning it came in."""
    reasoning, content = assistant.get("reasoning_content"), assistant.get("content")
    finish = str(row.get("finish_reason") or ("tool_calls" if assistant.get("tool_calls") else "stop"))
    if row.get("reasoning_end") == "implicit" and not assistant.get("tool_calls"):
        reasoning, content = (reasoning or "") + (content or ""), None
    return _Parts(reasoning, content, assistant.get("tool_calls") or None, finish)


__all__ = ["DatasetReport", "Defect", "Validation", "Validator", "check_manifests", "dataset_files",
           "print_report", "row_form", "validate"]
