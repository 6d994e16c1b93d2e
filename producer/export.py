"""``specfleet export OUT DIR``: an output folder as a Hugging Face dataset a trainer loads directly.

``DIR`` gets three things:

- ``data/<split>-00000-of-00001.parquet``: one split per dataset (its shards), and
  ``<dataset>_truncated`` for the rows a ``truncated = "separate"`` run set apart (and
  ``<dataset>_degenerate`` for a ``degenerate = "separate"`` run's); ``--recipe NAME`` (repeatable)
  keeps only the rows asked with those sampling recipes (``row["sampling"]["recipe"]``);
  ``load_dataset("parquet", data_files=…)``, or ``load_dataset(DIR)`` through the card's ``configs``;
- ``arrow/``: the same splits as a ``datasets.DatasetDict.save_to_disk`` folder (``load_from_disk``);
- ``README.md``: the dataset card, from ``OUT/manifest.json`` and the rows: model, tokenizer (source,
  revision, files' sha256), chat template sha256, request parameters, provider policy and mix per
  dataset, counts, how the rows were made and how to load them.

Columns have one fixed schema (``FEATURES``): free-form fields whose shape varies per row
(``tools``, ``engine_check``, any field specfleet does not know) are JSON strings, so shards of
different runs and datasets always stack. ``--push-to-hub REPO`` uploads the Parquet files and the
card through ``huggingface_hub`` (token: ``HF_TOKEN`` or the hub's login; endpoint ``HF_ENDPOINT``).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError, OutputError
from common.manifest import MANIFEST, Manifest, read_manifests

log = logging.getLogger(__name__)

TRUNCATED_FILE = "truncated.jsonl"
DEGENERATE_FILE = "degenerate.jsonl"
#: producer/share.py's (not imported: the export reads a folder, the run's modules need not load).
SHARED_FILE = "shared.jsonl"
DATA_DIR = "data"
ARROW_DIR = "arrow"
#: Row fields kept as typed columns; the rest of a row goes to ``extra`` (a JSON object string).
_TYPED = ("id", "key", "turn", "conversations", "input_ids", "loss_mask", "num_tokens", "finish_reason",
          "reasoning_end", "usage", "provider", "quantization", "model", "generation_id", "attempts", "where",
          "manifest", "tools", "engine_check", "conversation_end")
_MESSAGE_KEYS = ("role", "content", "reasoning_content", "name", "tool_call_id")


def features() -> Any:
    """The one schema every exported row has (``datasets.Features``)."""
    from datasets import Features, List, Value

    call = {"id": Value("string"), "type": Value("string"),
            "function": {"name": Value("string"), "arguments": Value("string")}}
    message = {**{k: Value("string") for k in _MESSAGE_KEYS}, "tool_calls": List(call)}
    return Features({
        "id": Value("string"), "key": Value("string"), "turn": Value("int32"),
        "conversations": List(message),
        "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
        "num_tokens": Value("int64"), "finish_reason": Value("string"), "reasoning_end": Value("string"),
        "usage": {"prompt_tokens": Value("int64"), "completion_tokens": Value("int64"),
                  "reasoning_tokens": Value("int64"), "cost": Value("float64")},
        "provider": Value("string"), "quantization": Value("string"), "model": Value("string"),
        "generation_id": Value("string"), "attempts": Value("int32"), "where": Value("string"),
        "manifest": Value("string"), "tools": Value("string"), "engine_check": Value("string"),
        "conversation_end": Value("string"), "extra": Value("string"),
    })


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _message(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: _text(m.get(k)) for k in _MESSAGE_KEYS}
    out["tool_calls"] = [
        {"id": _text(c.get("id")), "type": _text(c.get("type")) or "function",
         "function": {"name": _text((c.get("function") or {}).get("name")),
                      "arguments": _text((c.get("function") or {}).get("arguments"))}}
        for c in m.get("tool_calls") or []
    ]
    return out


def to_record(row: dict[str, Any]) -> dict[str, Any]:
    """A specfleet row in the export's fixed schema."""
    usage = row.get("usage") or {}
    extra = {k: v for k, v in row.items() if k not in _TYPED}
    return {
        "id": _text(row.get("id")), "key": _text(row.get("key")), "turn": row.get("turn"),
        "conversations": [_message(m) for m in row.get("conversations") or []],
        "input_ids": row.get("input_ids") or [], "loss_mask": row.get("loss_mask") or [],
        "num_tokens": row.get("num_tokens"), "finish_reason": row.get("finish_reason"),
        "reasoning_end": row.get("reasoning_end"),
        "usage": {k: usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens", "reasoning_tokens", "cost")},
        "provider": row.get("provider"), "quantization": row.get("quantization"), "model": row.get("model"),
        "generation_id": row.get("generation_id"), "attempts": row.get("attempts"), "where": row.get("where"),
        "manifest": row.get("manifest"), "tools": _text(row.get("tools")),
        "engine_check": _text(row.get("engine_check")), "conversation_end": row.get("conversation_end"),
        "extra": json.dumps(extra, ensure_ascii=False) if extra else None,
    }


@dataclass
class SplitStats:
    name: str
    dataset: str
    rows: int = 0
    kept_tokens: int = 0
    truncated: int = 0
    providers: Counter[str] = field(default_factory=Counter)
    files: list[Path] = field(default_factory=list)


def splits_of(out: Path) -> list[SplitStats]:
    """The splits of an output folder: each dataset's shards (and the rows its duplicates were given,
    shared.jsonl: producer/share.py), and its truncated.jsonl apart."""
    splits = []
    for sub in sorted(p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")):
        shards = sorted(sub.glob("shard-*.jsonl"))
        if (sub / SHARED_FILE).is_file() and (sub / SHARED_FILE).stat().st_size:
            shards.append(sub / SHARED_FILE)
        if shards:
            splits.append(SplitStats(sub.name, sub.name, files=shards))
        if (sub / TRUNCATED_FILE).is_file():
            splits.append(SplitStats(f"{sub.name}_truncated", sub.name, files=[sub / TRUNCATED_FILE]))
        if (sub / DEGENERATE_FILE).is_file():
            splits.append(SplitStats(f"{sub.name}_degenerate", sub.name, files=[sub / DEGENERATE_FILE]))
    if not splits:
        raise ConfigError(f"{out}: no <dataset>/shard-*.jsonl to export")
    return splits


def recipe_of(row: dict[str, Any]) -> str | None:
    """The sampling recipe a row was asked with (None: its dataset named no mixture)."""
    sampling = row.get("sampling")
    return str(sampling.get("recipe")) if isinstance(sampling, dict) else None


def _records(split: SplitStats, recipes: frozenset[str] | None = None) -> Iterator[dict[str, Any]]:
    for path in split.files:
        with path.open("rb") as fh:
            for number, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                except ValueError as exc:
                    raise ConfigError(f"{path}:{number}: not JSON ({exc}); run specfleet validate") from None
                if recipes is not None and recipe_of(row) not in recipes:
                    continue
                split.rows += 1
                split.kept_tokens += int(row.get("num_tokens") or 0)
                split.truncated += row.get("finish_reason") == "length"
                split.providers[f"{row.get('provider') or '?'}|{row.get('quantization') or '?'}"] += 1
                yield to_record(row)


@dataclass
class Export:
    dest: Path
    splits: list[SplitStats]
    manifests: dict[str, Manifest]

    @property
    def card(self) -> Path:
        return self.dest / "README.md"


def export(out: Path, dest: Path, *, overwrite: bool = False, batch_rows: int = 1_000,
           recipes: list[str] | None = None) -> Export:
    """Write ``dest`` (Parquet, save_to_disk, card) from the output folder ``out``. Rows stream
    through in batches of ``batch_rows``: memory holds one batch, never a split. ``recipes``: only
    the rows asked with these sampling recipes (names as the manifest and rows give them)."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    if not out.is_dir():
        raise ConfigError(f"{out}: no such output folder")
    if dest.exists() and any(dest.iterdir()):
        if not overwrite:
            raise ConfigError(f"{dest}: not empty (give another folder, or --overwrite)")
        shutil.rmtree(dest)
    manifests = read_manifests(out) if (out / MANIFEST).is_file() else {}
    splits = splits_of(out)
    wanted = frozenset(recipes) if recipes else None
    if wanted is not None and manifests:
        known = {name for m in manifests.values() for by_name in m.sampling.values() for name in by_name}
        if unknown := sorted(wanted - known):
            raise ConfigError(f"--recipe {', '.join(unknown)}: not a sampling recipe of {out} "
                              f"(its recipes: {', '.join(sorted(known)) or 'none'})")
    feats = features()
    schema = feats.arrow_schema
    try:
        (dest / DATA_DIR).mkdir(parents=True, exist_ok=True)
        parquet: dict[str, str] = {}
        for split in splits:
            path = dest / DATA_DIR / f"{split.name}-00000-of-00001.parquet"
            with pq.ParquetWriter(str(path), schema) as writer:
                batch: list[dict[str, Any]] = []
                for record in _records(split, wanted):
                    batch.append(record)
                    if len(batch) >= batch_rows:
                        writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                        batch = []
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
            parquet[split.name] = str(path)
        # A cache of its own, dropped after: datasets' shared cache would hand back an older
        # export of the same paths.
        with tempfile.TemporaryDirectory(prefix="specfleet-export-") as cache:
            built = {name: Dataset.from_parquet(path, features=feats, cache_dir=cache, split=name)
                     for name, path in parquet.items()}
            DatasetDict(built).save_to_disk(str(dest / ARROW_DIR))
        result = Export(dest, splits, manifests)
        result.card.write_text(dataset_card(result), encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"{dest}: cannot write the export: {exc.strerror or exc}") from None
    log.info("exported %s to %s: %s", out, dest, ", ".join(f"{s.name} {s.rows:,} rows" for s in splits))
    return result


def dataset_card(result: Export) -> str:
    """The card: YAML front matter (the splits' Parquet files, so ``load_dataset(repo)`` finds them)
    and the provenance from the manifest(s)."""
    yaml = ["---", "configs:", "- config_name: default", "  data_files:"]
    for s in result.splits:
        yaml += [f"  - split: {s.name}", f"    path: {DATA_DIR}/{s.name}-*.parquet"]
    yaml += ["tags:", "- specfleet", "- eagle3", "- speculative-decoding", "---", ""]
    manifests = list(result.manifests.values())
    models = sorted({m.model for m in manifests})
    lines = ["# Token-exact drafter training rows (specfleet)", ""]
    lines += [f"Target model: {', '.join(f'`{m}`' for m in models) or 'not recorded (no manifest.json)'}.", ""]
    lines += ["Each row is one generation of the target model, rebuilt token for token: `input_ids` = the "
              "prompt as the chat template renders it with the generation prompt + the completion the "
              "model emitted (reasoning, `</think>`, content, tool calls, end-of-turn token when the turn "
              "ended); `loss_mask` is 1 exactly on the completion, `num_tokens` its sum. `conversations` "
              "holds the same turn as messages (SpecForge's form). Made by specfleet from prompt datasets "
              "through the API named below; each row passed the workers' self-checks when it was kept (the "
              "ids decode back to the text, every special-token string is its single id, the template "
              "renders the same turn) and `specfleet validate` re-checks a folder of them.", ""]
    lines += ["## Splits", "",
              "| split | rows | kept tokens | cut by max_tokens | providers (provider / quantization) |",
              "| --- | ---: | ---: | ---: | --- |"]
    for s in result.splits:
        mix = ", ".join(f"{k.replace('|', ' / ')} {v:,}" for k, v in s.providers.most_common()) or "-"
        lines.append(f"| {s.name} | {s.rows:,} | {s.kept_tokens:,} | {s.truncated:,} | {mix} |")
    lines.append("")
    for s in result.splits:
        served = {k.split("|")[0] for k in s.providers}
        quants = {k.split("|", 1)[1] for k in s.providers}
        if len(served) > 1 or len(quants) > 1:
            lines.append(f"Note: {s.name} was served by {len(served)} provider(s) and {len(quants)} "
                         "quantization(s); a drafter trained on it learns their mixture.")
    lines.append("")
    for m in manifests:
        lines += [f"## Provenance (manifest `{m.manifest_id}`)", ""]
        lines += [f"- specfleet {m.specfleet_version}; run {m.started_at} → {m.ended_at or 'not ended'}",
                  f"- model `{m.model}`",
                  f"- tokenizer `{m.tokenizer.source}`"
                  + (f" @ `{m.tokenizer.revision}`" if m.tokenizer.revision else ""),
                  f"- chat template sha256 `{m.chat_template_sha256}`",
                  f"- providers policy `{m.providers_policy}`; provider preferences "
                  f"`{json.dumps(m.provider, sort_keys=True)}`",
                  f"- truncated rows: `{m.truncated_policy}`; degenerate rows (`quality`): `{m.degenerate_policy}`",
                  *_distillation_lines(m),
                  *[f"- sampling recipes of {name}: "
                    + ", ".join(f"`{label}` {json.dumps(p, sort_keys=True)}" for label, p in by_name.items())
                    for name, by_name in m.sampling.items()],
                  f"- request parameters `{json.dumps(m.request, sort_keys=True)}`", "",
                  "| tokenizer file | sha256 |", "| --- | --- |"]
        lines += [f"| {name} | `{digest}` |" for name, digest in sorted(m.tokenizer.files.items())]
        lines += ["", "| dataset | budget tokens | budget USD | truncated |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {name} | {d.budget_tokens:,} | {d.budget_usd if d.budget_usd is not None else '-'} | "
                  f"{d.truncated:,} |" for name, d in m.datasets.items()]
        lines.append("")
    if not manifests:
        lines += ["## Provenance", "", "The output folder had no `manifest.json` (made before specfleet "
                  "recorded one): the tokenizer and template that made these ids are not recorded.", ""]
    lines += ["## Loading", "", "```python", "from datasets import load_dataset, load_from_disk",
              f'ds = load_dataset("parquet", data_files={{"{result.splits[0].name}": '
              f'"{DATA_DIR}/{result.splits[0].name}-*.parquet"}})',
              f'ds = load_from_disk("{ARROW_DIR}")  # the same splits, Arrow', "```", "",
              "`tools`, `engine_check` and `extra` (fields without a fixed shape) are JSON strings.", ""]
    return "\n".join(yaml + lines)


def _distillation_lines(m: Manifest) -> list[str]:
    """The model's distillation permission as the run read it."""
    read = m.distillation
    if not read:
        return ["- distillation permission: not recorded (a run from before specfleet read it)"]
    allowed = {True: "allowed", False: "**not allowed**", None: "not stated"}[read.get("is_trainable_text")]
    line = (f"- distillation: {allowed} by the model's author per OpenRouter's models list "
            f"(`is_trainable_text`, {read.get('source') or '-'}, read {read.get('read_at') or 'never'}; "
            "best-effort information: the licence is yours to check); requests carried "
            f"`provider.enforce_distillable_text`: {'yes' if read.get('enforce_distillable_text') else 'no'}")
    if read.get("allow_non_distillable"):
        line += "; the owner set `allow_non_distillable = true`"
    return [line]


def push_to_hub(result: Export, repo: str, *, private: bool = False, token: str | None = None,
                endpoint: str | None = None) -> str:
    """Upload the Parquet files and the card to the dataset repo ``repo``; its URL."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    try:
        url = api.create_repo(repo, repo_type="dataset", private=private, exist_ok=True)
        api.upload_folder(repo_id=repo, repo_type="dataset", folder_path=str(result.dest),
                          allow_patterns=[f"{DATA_DIR}/*.parquet", "README.md"],
                          commit_message="specfleet export")
    except Exception as exc:  # network, auth, hub refusals: one line for the user
        raise OutputError(f"cannot push to the hub dataset {repo!r}: {exc}") from None
    return str(url)


__all__ = ["Export", "dataset_card", "export", "features", "push_to_hub", "splits_of", "to_record"]
