"""The run report: markdown table values, a valid PNG, graceful with partial inputs."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from producer.report import REPORT_PNG, smoothed_rate, table_row, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

T0 = 1_700_000_000.0


def _timeline(dataset: str, start_s: float, limit: int, tokens_per_s: int, n: int) -> list[dict[str, Any]]:
    return [
        {
            "dataset": dataset,
            "t_s": start_s + i,
            "limit": limit,
            "kept_tokens": min(limit, i * tokens_per_s),
            "rows": i,
            "failed": 0,
            "state": "active",
            "errors": {"http_429": i // 10, "timeout": 1},
            "failures": {},
        }
        for i in range(n)
    ]


def _summary(**over: Any) -> dict[str, Any]:
    base = {
        "dataset": "short",
        "end_reason": "budget",
        "results": 120,
        "failed": 3,
        "skipped": 1,
        "malformed": 2,
        "tokens": 9_000,
        "budget_tokens": 10_000,
        "billed_prompt_tokens": 4_000,
        "billed_completion_tokens": 9_900,
        "cost_usd": 0.123456,
        "wall_s": 60.0,
    }
    base.update(over)
    return base


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    return width, height


def _table(md: str) -> dict[str, dict[str, str]]:
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def test_report_files_and_table(tmp_path: Path) -> None:
    summaries = [
        _summary(extra_key={"anything": 1}),
        _summary(
            dataset="long",
            end_reason="exhausted prompts",
            results=10,
            tokens=50_000,
            budget_tokens=100_000,
            billed_completion_tokens=60_000,
            cost_usd=1.5,
            wall_s=100.0,
            malformed=None,
        ),
    ]
    timelines = {
        "short": _timeline("short", T0, 10_000, 150, 70),
        "long": _timeline("long", T0 + 70, 100_000, 500, 110),
    }
    md_path = write_report(tmp_path / "out", summaries, timelines)

    assert md_path == tmp_path / "out" / "report.md"
    md = md_path.read_text()
    assert f"]({REPORT_PNG})" in md
    width, height = _png_size(tmp_path / "out" / REPORT_PNG)
    assert width > 800 and height > 600

    rows = _table(md)
    short, long_, total = rows["short"], rows["long"], rows["**total**"]
    assert short["end reason"] == "budget"
    assert short["results"] == "120"
    assert short["failed"] == "3"
    assert short["skipped"] == "1"
    assert short["malformed"] == "2"
    assert short["kept tokens"] == "9,000"
    assert short["budget"] == "10,000"
    assert short["budget used"] == "90.0%"
    assert short["billed prompt"] == "4,000"
    assert short["billed completion"] == "9,900"
    assert short["billed/kept"] == "1.10"
    assert short["cost (USD)"] == "0.1235"
    assert short["wall"] == "1m00s"
    assert short["rows/s"] == "2.00"
    assert long_["malformed"] == "-"  # None is "unknown", not zero
    assert long_["rows/s"] == "0.10"
    assert total["results"] == "130"
    assert total["kept tokens"] == "59,000"
    assert total["cost (USD)"] == "1.6235"
    assert total["wall"] == "2m40s"
    # Error classes come from each dataset's last timeline sample.
    assert "- **short**: timeout 1, http_429 6" in md or "- **short**: http_429 6, timeout 1" in md
    assert "- **long**: http_429 10, timeout 1" in md


def test_report_with_missing_data(tmp_path: Path) -> None:
    # A crashed run: a summary with almost nothing, no timelines at all.
    md_path = write_report(tmp_path, [{"dataset": "only"}], {})
    row = _table(md_path.read_text())["only"]
    assert row["results"] == "-"
    assert row["billed/kept"] == "-"
    assert row["rows/s"] == "-"
    assert "**total**" not in md_path.read_text()
    _png_size(tmp_path / REPORT_PNG)


def test_report_overwrites_previous(tmp_path: Path) -> None:
    write_report(tmp_path, [_summary(results=1)], {})
    write_report(tmp_path, [_summary(results=2)], {"short": _timeline("short", T0, 10_000, 10, 5)})
    assert _table((tmp_path / "report.md").read_text())["short"]["results"] == "2"
    assert not list(tmp_path.glob("*.tmp"))


def test_table_row_ignores_nonsense_values() -> None:
    row = table_row({"dataset": "x", "results": "12", "tokens": float("nan"), "wall_s": 0, "cost_usd": True})
    assert row[2] == "-"  # a string is not a count
    assert row[6] == "-"
    assert row[-1] == "-"  # no division by a zero wall time
    assert row[-3] == "-"


def test_smoothed_rate() -> None:
    t = [0.0, 1.0, 2.0, 3.0, 10.0]
    kept = [0.0, 100.0, 200.0, 300.0, 300.0]
    rates = smoothed_rate(t, kept, window_s=2.0)
    assert rates[0] == 0.0
    assert rates[1:4] == [100.0, 100.0, 100.0]
    assert rates[4] == 0.0  # a stall shows as zero, not as the old rate


def test_report_shows_the_fleet_throttle(tmp_path: Path) -> None:
    summaries = [
        _summary(throttle={"limit": 271.4, "ok": 3_960, "throttled": 40, "throttled_share": 0.01}),
        _summary(dataset="long", throttle={"limit": None, "ok": 10, "throttled": 0, "throttled_share": 0.0}),
        _summary(dataset="old"),  # a summary written before the throttle existed
    ]
    md = write_report(tmp_path, summaries, {}).read_text()
    assert "## Upstream throttle (whole fleet)" in md
    assert "- **short**: in-flight limit 271 · 429s 1.00% (40 of 4,000 upstream answers)" in md
    assert "- **long**: in-flight limit unbounded (no 429 yet, no cap) · 429s 0.00% (0 of 10" in md
    assert "**old**: in-flight" not in md
