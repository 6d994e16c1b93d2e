"""The per-dataset Summary: summary.json round-trips, and the printed line says what ended the run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from producer.report import REPORT_MD, write_report
from producer.summary import Summary, report_line


def _summary(**over: Any) -> Summary:
    base = Summary(dataset="short", end_reason="budget", prompts=200, results=120, results_this_run=100, failed=3,
                   skipped=77, malformed=2, tokens=9_000, budget_tokens=10_000, billed_prompt_tokens=4_000,
                   billed_completion_tokens=9_900, billed_reasoning_tokens=500, cost_usd=0.123456, requests=130,
                   duplicates=1, errors={"http_429": 4}, failures={"token_mismatch": 3}, wall_s=61.25,
                   shards=["shard-00000.jsonl"])
    return dataclasses.replace(base, **over)


def test_summary_json_round_trips_and_tolerates_keys_of_other_versions() -> None:
    s = _summary()
    data = json.loads(s.dumps())
    assert data["tokens"] == 9_000 and data["errors"] == {"http_429": 4} and data["shards"] == ["shard-00000.jsonl"]
    assert Summary.from_json(data) == s
    assert Summary.from_json({**data, "a_field_of_a_newer_version": 5.0}) == s  # a newer file read by this one


def test_report_line_says_why_the_dataset_ended() -> None:
    assert report_line(_summary()) == (
        "short: budget reached, 9,000 of 10,000 tokens · $0.1235 · results 120 · skipped 77 · failed 3 · "
        "malformed 2 · billed 9,900 completion tokens · 61.2 s")
    assert report_line(_summary(end_reason="complete")).startswith("short: all prompts done, 9,000 of 10,000 tokens")
    assert report_line(_summary(end_reason="stalled")).startswith("short: stalled, 9,000 of 10,000 tokens")


def test_the_report_takes_summaries_as_the_run_returns_them(tmp_path: Path) -> None:
    write_report(tmp_path, [_summary(), _summary(dataset="long").to_json()], {})
    table = (tmp_path / REPORT_MD).read_text()
    assert "| short | budget | 120 |" in table and "| long | budget | 120 |" in table
