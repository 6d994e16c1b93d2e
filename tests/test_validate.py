"""``specfleet validate``: a real fleet's output folder passes, and each of eight corruptions of it
is named by ``file:line`` (and only that line): a flipped id, a shifted mask, a duplicate id across
shards, a leaked ``<|im_end|>``, a wrong tokenizer recorded, a truncated row kept under ``drop``, a
row from an unpinned provider under ``pin``, a hand-edited content. Rows in SpecForge's and
speculators' forms are read too."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.manifest import identity, manifest_id
from harness import zygote
from producer.validate import Defect, validate
from tests.fleet import DEMO_TOKENIZER, REPO, Fleet
from tests.run_output import demo_like_run

pytestmark = pytest.mark.fleet

END = "<|im_end|>"


@pytest.fixture
def run_out(fleet: Fleet) -> Path:
    return demo_like_run(fleet)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _where(defects: list[Defect]) -> set[tuple[str, int]]:
    return {(d.path.name, d.line) for d in defects}


def _all_rows(out: Path) -> list[tuple[Path, int, dict[str, Any]]]:
    found = []
    for path in sorted((out / "V").glob("*.jsonl")):
        if path.name.startswith("shard-") or path.name == "truncated.jsonl":
            found += [(path, i + 1, row) for i, row in enumerate(_lines(path))]
    return found


def _edit(out: Path, pick: Callable[[dict[str, Any]], bool], change: Callable[[dict[str, Any]], None]
          ) -> tuple[str, int]:
    """Change the first row ``pick`` chooses, in place; its (file name, line)."""
    for path, line, row in _all_rows(out):
        if pick(row):
            rows = _lines(path)
            change(rows[line - 1])
            _write(path, rows)
            return path.name, line
    raise AssertionError("no row to corrupt")


def _plain(row: dict[str, Any]) -> bool:
    return row.get("finish_reason") == "stop" and isinstance(row["conversations"][-1].get("content"), str) \
        and len(row["conversations"][-1]["content"]) > 10


def _flip_id(row: dict[str, Any]) -> None:
    at = len(row["input_ids"]) - 3
    row["input_ids"][at] = row["input_ids"][at] + 1


def _shift_mask(row: dict[str, Any]) -> None:
    start = row["loss_mask"].index(1)
    row["loss_mask"] = [*row["loss_mask"][1:], 1]
    assert row["loss_mask"].index(1) == start - 1


def _leak(row: dict[str, Any]) -> None:
    row["conversations"][-1]["content"] += END


def _hand_edit(row: dict[str, Any]) -> None:
    content = row["conversations"][-1]["content"]
    row["conversations"][-1]["content"] = content[:5] + "X" + content[6:]


def _provider_counts(out: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, _, row in _all_rows(out):
        key = f"{row.get('provider') or '?'}|{row.get('quantization') or '?'}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _count_line(out: Path) -> int:
    lines = (out / "manifest.json").read_text().splitlines()
    return next(i for i, t in enumerate(lines, 1) if t.strip().startswith('"V"'))


def _manifest(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "manifest.json").read_text()))


def _rewrite_manifest(out: Path, **changes: Any) -> dict[str, Any]:
    """The manifest with ``changes``, its id recomputed and every row re-stamped with it: a folder as
    a run under those settings would have written it."""
    m = {**_manifest(out), **changes}
    from common.manifest import TokenizerInfo

    new_id = manifest_id(identity(m["model"], TokenizerInfo(**m["tokenizer"]), m["chat_template_sha256"],
                                  m["request"], m["provider"], m["providers_policy"]))
    m["manifest_id"] = new_id
    (out / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    for path in {p for p, _, _ in _all_rows(out)}:
        rows = _lines(path)
        for row in rows:
            row["manifest"] = new_id
        _write(path, rows)
    return m


def test_a_run_passes_and_eight_corruptions_are_each_named_by_file_and_line(run_out: Path, tmp_path: Path) -> None:
    # The CLI on the run's folder as it is: exit 0, a table per dataset.
    done = zygote.run([sys.executable, "-m", "producer.cli", "validate", str(run_out)],
                      cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "OK: 24 rows, 0 defects" in done.stdout, done.stdout[-3000:]
    shards = sorted((run_out / "V").glob("shard-*.jsonl"))
    assert len(shards) >= 2 and (run_out / "V" / "truncated.jsonl").is_file(), sorted((run_out / "V").iterdir())

    def corrupt(name: str) -> Path:
        copy = tmp_path / name
        shutil.copytree(run_out, copy, ignore=shutil.ignore_patterns(".valkey"))
        return copy

    cases: dict[str, tuple[Path, set[tuple[str, int]], str]] = {}

    out = corrupt("flipped")
    cases["flipped id"] = (out, {_edit(out, _plain, _flip_id)}, "completion ids differ")
    out = corrupt("mask")
    cases["shifted mask"] = (out, {_edit(out, _plain, _shift_mask)}, "loss_mask starts at token")
    out = corrupt("duplicate")
    first, second = sorted((out / "V").glob("shard-*.jsonl"))[:2]
    rows = _lines(second)
    _write(second, [*rows, _lines(first)[0]])
    # One row more than the manifest counted: its count of the dataset's rows is named too.
    cases["duplicate id across shards"] = (out, {(second.name, len(rows) + 1), ("manifest.json", _count_line(out))},
                                           f"(first at {first}:1)")
    out = corrupt("leak")
    cases["leaked <|im_end|>"] = (out, {_edit(out, _plain, _leak)}, "holds '<|im_end|>'")
    out = corrupt("hand-edit")
    cases["hand-edited content"] = (out, {_edit(out, _plain, _hand_edit)}, "completion ids differ")

    out = corrupt("tokenizer")
    m = _manifest(out)
    m["tokenizer"]["files"]["tokenizer.json"] = "0" * 64
    text = json.dumps(m, indent=2) + "\n"
    (out / "manifest.json").write_text(text)
    line = next(i for i, t in enumerate(text.splitlines(), 1) if '"tokenizer.json"' in t)
    cases["wrong tokenizer recorded"] = (out, {("manifest.json", line), ("manifest.json", 2)},
                                         "tokenizer file tokenizer.json: recorded sha256 " + "0" * 64)

    out = corrupt("drop")
    m = _manifest(out)
    m["truncated_policy"] = "drop"
    (out / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    cut = {("truncated.jsonl", 1), ("truncated.jsonl", 2)}
    cases["truncated row kept under drop"] = (out, cut, 'kept under truncated = "drop"')

    out = corrupt("pin")
    served = [row["provider"] for _, _, row in _all_rows(out)]
    pinned = max(set(served), key=served.count)
    _rewrite_manifest(out, providers_policy="pin", provider={"only": [pinned], "allow_fallbacks": False})
    for path in {p for p, _, _ in _all_rows(out)}:
        rows = _lines(path)
        for row in rows:
            row["provider"] = pinned
        _write(path, rows)
    where = _edit(out, _plain, lambda row: row.update(provider="SomeOtherProvider"))
    m = _manifest(out)  # counted as the rows are, so only the pin is wrong
    m["datasets"]["V"]["providers"] = _provider_counts(out)
    (out / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    cases["unpinned provider under pin"] = (out, {where}, "provider 'SomeOtherProvider' under providers = \"pin\"")

    assert len(cases) == 8
    for what, (folder, expected, reason) in cases.items():
        result = validate(folder)
        assert not result.ok, what
        assert _where(result.defects) == expected, (what, [str(d) for d in result.defects])
        assert any(reason in d.reason or reason in str(d) for d in result.defects), \
            (what, [str(d) for d in result.defects])


def test_specforge_and_speculators_rows_are_read(run_out: Path, tmp_path: Path) -> None:
    rows = [row for _, _, row in _all_rows(run_out) if row["finish_reason"] == "stop"]
    specforge = [{"id": r["id"], "conversations": r["conversations"]} for r in rows]
    specforge[1]["conversations"][-1]["content"] = "An answer with a </think> marker in it."
    speculators = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows]
    end_id = speculators[2]["input_ids"][-1]
    speculators[2]["input_ids"].insert(len(speculators[2]["input_ids"]) - 2, end_id)
    speculators[2]["loss_mask"].append(1)
    _write(tmp_path / "specforge.jsonl", specforge)
    _write(tmp_path / "speculators.jsonl", speculators)

    result = validate(tmp_path / "specforge.jsonl", tokenizer=str(DEMO_TOKENIZER))
    assert [(d.line, "'</think>'" in d.reason) for d in result.defects] == [(2, True)], result.defects
    assert result.datasets[0].forms == {"specforge": len(rows)}
    result = validate(tmp_path / "speculators.jsonl", tokenizer=str(DEMO_TOKENIZER))
    assert [d.line for d in result.defects] == [3], result.defects
    assert "end-of-turn id inside the trained span" in result.defects[0].reason
