"""Datasets as users hold them (common/datasets.py): gzip and zstd JSONL, Parquet (a file, a folder
or glob of shards) and a ``datasets.save_to_disk`` folder read to the same prompts, with the same
content ids, as the JSONL they were made from, and a real fleet writes the same rows from each; a
bad row in each format is named by file and line (JSONL) or row (columnar) and by its field."""

from __future__ import annotations

import contextlib
import gzip
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import zstandard

from common.datasets import ReadStats, dataset_problem, read_prompts
from common.errors import DatasetRowError
from tests.fleet import REPO, Fleet, read_rows, read_summary

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

DEMO = REPO / "demo" / "data"
#: The demo's lines and the rows among them that are JSON (``demo_rows``).
DemoRows = tuple[list[str], list[dict[str, Any]]]


def demo_rows(b1: int = 150, b4: int | None = None) -> DemoRows:
    """The demo's lines: the first ``b1`` of B1 (OpenAI form, tools; its 8th line is not JSON) and
    the first ``b4`` of B4 (ShareGPT: rows without an id, a bad speaker at 13, a duplicate at 148;
    None: all 301), one file mixing both forms. Returns the lines and the rows that are JSON (a
    columnar file cannot hold a line that is not)."""
    lines = (DEMO / "b1_glaive.jsonl").read_text().splitlines()[:b1]
    lines += (DEMO / "b4_mixturethoughts.jsonl").read_text().splitlines()[:b4]
    rows = []
    for line in lines:
        with contextlib.suppress(ValueError):  # the demo's lines that are not JSON stay JSONL's alone
            rows.append(json.loads(line))
    return lines, rows


def columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    # Every key of every row: pyarrow's from_pylist would take the first row's keys only.
    return {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}


def write_formats(folder: Path, demo: DemoRows | None = None) -> dict[str, Path]:
    """``demo`` (``demo_rows()`` unless given) as JSONL and in every other format the reader takes."""
    import datasets  # ~0.8 s to import: only in the tests that write a saved folder
    folder.mkdir(parents=True, exist_ok=True)
    lines, rows = demo if demo is not None else demo_rows()
    raw = ("\n".join(lines) + "\n").encode()
    jsonl = folder / "demo.jsonl"
    jsonl.write_bytes(raw)
    (folder / "demo.jsonl.gz").write_bytes(gzip.compress(raw))
    (folder / "demo.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    table = pa.Table.from_pydict(columns(rows))
    pq.write_table(table, folder / "demo.parquet", row_group_size=64)
    shards = folder / "shards"
    shards.mkdir()
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), shards / "train-00000.parquet")
    pq.write_table(table.slice(half), shards / "train-00001.parquet")
    datasets.Dataset.from_dict(columns(rows)).save_to_disk(str(folder / "saved"), num_shards=2)
    return {"jsonl": jsonl, "gz": folder / "demo.jsonl.gz", "zst": folder / "demo.jsonl.zst",
            "parquet": folder / "demo.parquet", "shards": shards, "glob": shards / "train-*.parquet",
            "saved": folder / "saved"}


def read(path: Path) -> tuple[list[tuple[str, Any, Any]], ReadStats, list[DatasetRowError]]:
    errors: list[DatasetRowError] = []
    stats = ReadStats()
    prompts = [(p.id, p.messages, p.tools) for p in read_prompts(path, errors, stats)]
    return prompts, stats, errors


def test_every_format_reads_the_demo_data_to_the_prompts_and_ids_of_its_jsonl(tmp_path: Path) -> None:
    paths = write_formats(tmp_path)
    want, want_stats, _ = read(paths["jsonl"])
    assert want_stats.prompts == 150 - 2 + 299 and want_stats.duplicates == 1, want_stats
    assert any(pid.startswith("h-") for pid, _, _ in want)  # a content-hash id is among them
    for name, path in paths.items():
        got, stats, errors = read(path)
        assert got == want, name
        assert stats.duplicates == 1 and any("duplicate id" in e.reason for e in errors), (name, errors)
        if name in ("gz", "zst"):  # the same lines, the same line numbers
            assert [e.reason for e in errors] == [e.reason for e in read(paths["jsonl"])[2]]
            assert all(e.where.startswith(f"{path}:") for e in errors)


def test_a_missing_path_and_an_empty_folder_are_named(tmp_path: Path) -> None:
    assert "no such file" in str(dataset_problem(tmp_path / "nope.parquet"))
    assert "no file matches" in str(dataset_problem(tmp_path / "shard-*.parquet"))
    (tmp_path / "empty").mkdir()
    assert "no .parquet files" in str(dataset_problem(tmp_path / "empty"))


BAD_ROWS = [
    {"id": "good-1", "messages": [{"role": "user", "content": "hello"}]},
    {"id": "bad-role", "messages": [{"role": "wizard", "content": "hello"}]},
    {"id": "bad-speaker", "conversations": [{"from": "robot", "value": "beep"}]},
    {"id": "good-2", "messages": [{"role": "user", "content": "again"}]},
]


@pytest.mark.parametrize("form", ["gz", "zst", "parquet", "saved"])
def test_a_bad_row_is_named_by_file_and_line_or_row_and_field(tmp_path: Path, form: str) -> None:
    import datasets
    raw = "".join(json.dumps(r) + "\n" for r in BAD_ROWS).encode()
    if form == "gz":
        path = tmp_path / "d.jsonl.gz"
        path.write_bytes(gzip.compress(raw + b"{not json\n"))
    elif form == "zst":
        path = tmp_path / "d.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(raw + b"{not json\n"))
    elif form == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pydict(columns(BAD_ROWS)), path)
    else:
        path = tmp_path / "saved"
        datasets.Dataset.from_dict(columns(BAD_ROWS)).save_to_disk(str(path))
    got, stats, errors = read(path)
    assert [pid for pid, _, _ in got] == ["good-1", "good-2"]
    where = [e.where for e in errors]
    if form in ("gz", "zst"):
        assert where == [f"{path}:2", f"{path}:3", f"{path}:5"], where
        assert "not valid JSON" in errors[2].reason
    else:
        file = path if form == "parquet" else path / "data-00000-of-00001.arrow"
        assert where == [f"{file}:row 1", f"{file}:row 2"], where
    assert "messages[0].role" in errors[0].reason and "'wizard'" in errors[0].reason
    assert "conversations[0].from" in errors[1].reason and "'robot'" in errors[1].reason
    assert stats.malformed == len(errors)


def test_a_saved_folder_counts_rows_across_its_files_and_a_dataset_dict_names_its_split(tmp_path: Path) -> None:
    import datasets
    rows = [*BAD_ROWS[:1], *({"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(9)),
            BAD_ROWS[1]]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(columns(rows)).save_to_disk(str(saved), num_shards=3)
    _, _, errors = read(saved)
    assert [e.where for e in errors] == [f"{saved}/data-00002-of-00003.arrow:row 10"], errors
    one = tmp_path / "dict1"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns(rows))}).save_to_disk(str(one))
    assert len(read(one)[0]) == 10
    two = tmp_path / "dict2"
    both = datasets.Dataset.from_dict(columns(rows))
    datasets.DatasetDict({"train": both, "test": both}).save_to_disk(str(two))
    assert "set path to one split's folder" in str(dataset_problem(two))
    assert len(read(two / "test")[0]) == 10


def test_a_columnar_row_over_max_line_bytes_is_refused_by_its_row(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "x" * 5000}]},
            {"id": "b", "messages": [{"role": "user", "content": "short"}]}]
    pq.write_table(pa.Table.from_pydict(columns(rows)), path)
    errors: list[DatasetRowError] = []
    got = [p.id for p in read_prompts(path, errors, ReadStats(), max_line_bytes=1000)]
    assert got == ["b"]
    assert errors[0].where == f"{path}:row 0" and "row_too_long" in errors[0].reason


# --- the fleet ---------------------------------------------------------------------------------

#: What differs between two runs of the same prompt: when, who, which attempt, what it cost.
RUN_FIELDS = {"generation_id", "attempts", "where", "provider", "quantization"}


def stable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in RUN_FIELDS}


@pytest.mark.fleet
@pytest.mark.timeout(900)
@pytest.mark.long
def test_the_fleet_writes_the_same_rows_from_every_format(fleet: Fleet, redis_client: redis.Redis) -> None:
    # Fewer rows than the reader's test (each form is a run of its own: 6 x 447 rows cost 12 CPU-s),
    # still every kind of line: OpenAI and ShareGPT rows, a line that is not JSON, rows without an
    # id (content-hash ids), a bad speaker and a duplicate.
    paths = write_formats(fleet.tmp / "data", demo_rows(b1=40, b4=150))
    _, read_stats, _ = read(paths["jsonl"])
    assert read_stats.duplicates == 1 and read_stats.malformed == 3, read_stats
    # B1: its 8th line is not JSON, its 32nd has no user message; B4: a bad speaker, a duplicate.
    n_prompts = 40 - 2 + 150 - 2
    forms = ["jsonl", "gz", "zst", "parquet", "glob", "saved"]
    fleet.start_simulator("--latency-median-ms", "20")
    config = fleet.write_config([{"name": f"D_{form}", "path": paths[form], "length": "short",
                                  "budget_tokens": 10**9} for form in forms], timeout_s=60)
    fleet.start_worker("w1", concurrency=40)
    fleet.start_worker("w2", concurrency=40)
    fleet.run_producer(config, timeout_s=800)
    want = {r["id"]: stable(r) for r in read_rows(fleet.out, "D_jsonl")}
    assert len(want) == read_stats.prompts == n_prompts, (len(want), read_stats)
    assert all(r["conversations"] and r["input_ids"] and r["loss_mask"] for r in want.values())
    for form in forms:
        summary = read_summary(fleet.out, f"D_{form}")
        assert (summary["end_reason"], summary["prompts"], summary["failed"]) == ("complete", len(want), 0), \
            (form, summary)
        fleet.assert_exactly_once(redis_client, f"D_{form}", len(want))
        got = {r["id"]: stable(r) for r in read_rows(fleet.out, f"D_{form}")}
        assert got.keys() == want.keys(), form
        differ = [i for i in want if got[i] != want[i]]
        assert not differ, (form, differ[:3], got[differ[0]], want[differ[0]]) if differ else form
