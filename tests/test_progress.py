"""Progress view: plain lines when not a terminal (throttled), bars when live, rate and ETA maths."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest

from producer.progress import PLAIN_INTERVAL_S, ProgressView, TokenRate, eta_s, fmt_duration, fmt_tokens
from producer.state import DatasetState

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

T0 = 1_700_000_000.0


def _state(dataset: str = "short", t: float = 0.0, **over: Any) -> DatasetState:
    fields: dict[str, Any] = {
        "dataset": dataset,
        "t_s": T0 + t,
        "limit": 10_000,
        "kept_tokens": 0,
        "reserved_tokens": 0,
        "rows": 0,
        "failed": 0,
        "in_flight": 0,
        "queued": 0,
        "state": "active",
        "requests": 0,
        "billed_prompt_tokens": 0,
        "billed_completion_tokens": 0,
        "billed_reasoning_tokens": 0,
        "cost_usd": 0.0,
        "duplicates": 0,
        "skipped_by_workers": 0,
    }
    fields.update(over)
    return DatasetState(**fields)


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    view = ProgressView(["short", "long"], stream=out)
    assert view.live is False
    view.update([_state(t=0, kept_tokens=0), _state("long", state="")])
    view.update([_state(t=1, kept_tokens=100, rows=1), _state("long", t=1, state="")])
    lines = _lines(out)
    # First update prints at once; the second, a second later, is throttled; "long" is not started.
    assert len(lines) == 1
    assert "dataset=short" in lines[0] and "state=active" in lines[0]

    view.update([_state(t=PLAIN_INTERVAL_S, kept_tokens=1_000, rows=10, failed=2, in_flight=5, queued=7)])
    lines = _lines(out)
    assert len(lines) == 2
    last = lines[-1]
    assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d progress dataset=short ", last)
    assert "kept_tokens=1000/10000 (10.0%)" in last
    assert "rows=10 failed=2 in_flight=5 queued=7" in last
    # 1000 tokens over 10 s = 100 tok/s; 9000 left -> 90 s.
    assert "rate_tok_s=100.0" in last
    assert "eta=1m30s" in last


def test_state_change_prints_at_once_and_close_prints_final() -> None:
    out = io.StringIO()
    view = ProgressView(["short", "long"], live=False, stream=out)
    view.update([_state(t=0)])
    view.update([_state(t=2, kept_tokens=9_990, state="exhausted"), _state("long", t=2)])
    lines = _lines(out)
    assert len(lines) == 3  # not throttled: a state change is news
    assert "dataset=short state=exhausted" in lines[1] and "eta=-" in lines[1]
    assert "dataset=long state=active" in lines[2]
    view.update([_state("long", t=3, kept_tokens=500, rows=3)])
    view.close()
    view.close()  # idempotent
    lines = _lines(out)
    assert len(lines) == 4
    assert "dataset=long" in lines[3] and "kept_tokens=500/10000" in lines[3]


def test_plain_mode_is_quiet_for_datasets_not_started() -> None:
    out = io.StringIO()
    with ProgressView(["a"], live=False, stream=out) as view:
        view.update([_state("a", state="", limit=0)])
    assert out.getvalue() == ""


def test_live_bars_render_one_row_per_dataset() -> None:
    out = io.StringIO()
    view = ProgressView(["short", "long"], live=True, stream=out)
    view.update([_state(t=0), _state("long", state="", limit=0)])
    view.update([_state(t=10, kept_tokens=2_500, rows=25, failed=1), _state("long", t=10, state="", limit=0)])
    view.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    final = text[text.rfind("short") :]
    assert "2.50k/10.00k tok  25.0%" in final
    assert "rows 25" in final and "failed 1" in final
    assert "250 tok/s" in final
    assert "ETA 30s" in final
    assert "long" in final and "waiting" in final


def test_live_is_chosen_for_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    view = ProgressView(["x"], stream=Tty())
    try:
        assert view.live is True
    finally:
        view.close()


def test_token_rate_window_and_reset() -> None:
    rate = TokenRate(window_s=10)
    assert rate.observe(0, 0) is None
    assert rate.observe(5, 500) == 100
    assert rate.observe(5, 600) == 100  # same timestamp: ignored
    assert rate.observe(20, 2_000) == pytest.approx((2_000 - 500) / 15)
    # The window keeps one sample older than 10 s, so the rate spans at least the window: 5 -> 25 s.
    assert rate.observe(25, 2_000) == pytest.approx(1_500 / 20)
    assert rate.observe(31, 2_000) == pytest.approx(0.0)  # 20 -> 31 s: a stall reads as zero
    assert rate.observe(26, 10) is None  # counter went back: a new run, history dropped


def test_eta_and_formatting() -> None:
    assert eta_s(_state(kept_tokens=4_000), 100.0) == 60
    assert eta_s(_state(state="exhausted"), 100.0) is None
    assert eta_s(_state(), None) is None
    assert eta_s(_state(), 0.0) is None
    assert fmt_duration(None) == "-"
    assert fmt_duration(59.6) == "1m00s"
    assert fmt_duration(3 * 3600 + 120) == "3h02m"
    assert fmt_tokens(999) == "999"
    assert fmt_tokens(12_345_678) == "12.35M"


def test_the_fleet_throttle_shows_in_plain_lines_and_live_bars() -> None:
    from common.throttle import ThrottleSnapshot

    throttled = ThrottleSnapshot(limit=271.6, in_flight=268, pause_ms_left=800, ok=3_960, throttled=40)
    out = io.StringIO()
    view = ProgressView(["short"], live=False, stream=out)
    view.update([_state(t=0)], throttled)
    view.update([_state(t=1, kept_tokens=10)], throttled)  # not due: no second throttle line either
    lines = _lines(out)
    assert len(lines) == 2
    assert re.search(r"throttle limit=272 in_flight=268 throttled_share=1\.0% answers=4000 paused_ms=800$",
                     lines[1])

    out = io.StringIO()
    view = ProgressView(["short"], live=True, stream=out)
    view.update([_state(t=0)], ThrottleSnapshot(limit=None, in_flight=12, pause_ms_left=0, ok=5, throttled=0))
    view.update([_state(t=1)], throttled)
    view.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    final = text[text.rfind("upstream") :]
    assert "in flight 268/272" in final and "429s 1.0%" in final and "paused 0.8s" in final


def test_live_logging_goes_through_richs_handler_above_the_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    """While bars are live, the root logger writes through rich's RichHandler on the bars' console
    (which prints a line above the bars and redraws them below), with the secret scrubber kept;
    warnings go through logging too. After close, the handlers are back as they were."""
    import logging
    import warnings

    from rich.logging import RichHandler

    from common import logs

    monkeypatch.setenv("COLUMNS", "200")  # rich wraps a log line at the console's width
    logs.configure("INFO", ())
    before = logging.getLogger().handlers[:]
    out = io.StringIO()
    view = ProgressView(["short"], live=True, stream=out)
    try:
        (handler,) = logging.getLogger().handlers
        assert isinstance(handler, RichHandler) and handler.console is view._progress.console  # type: ignore[union-attr]
        assert any(isinstance(f, logs.RedactSecrets) for f in handler.filters)
        view.update([_state(t=0, kept_tokens=10, rows=1)])
        logging.getLogger("producer.run").warning("a line with sk-or-v1-%s in it", "0123456789abcdef")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
    finally:
        view.close()
    assert logging.getLogger().handlers == before
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "a line with [REDACTED] in it" in text and "sk-or-v1-0123" not in text
    assert "a library's warning" in text
    # Each redraw after a printed line puts the bars below it: the bar follows the log line.
    assert text.rfind("short") > text.find("a line with")


def test_finish_shows_the_final_state_whatever_an_older_read_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    out = io.StringIO()
    view = ProgressView(["short"], live=True, stream=out)
    view.update([_state(t=0, kept_tokens=1_000, rows=10)])
    view.finish(_state(t=2, kept_tokens=4_000, rows=40, state="stopped"), "complete")
    view.update([_state(t=1, kept_tokens=2_000, rows=20)])  # a read from before the end: ignored
    view.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    final = text[text.rfind("short") :]
    assert "rows 40" in final and "done: all prompts" in final and "ETA" not in final

    out = io.StringIO()
    view = ProgressView(["short"], live=False, stream=out)
    view.update([_state(t=0, kept_tokens=1_000, rows=10)])
    view.finish(_state(t=2, kept_tokens=4_000, rows=40, state="stopped"), "budget")
    view.close()
    assert "state=done" in _lines(out)[-1] and "rows=40" in _lines(out)[-1]


def _run_under_a_terminal(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """``cmd`` with a pseudo-terminal as stdin, stdout and stderr (rich draws live bars there);
    returns its exit status and everything it drew."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 240, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                            cwd=Path(__file__).resolve().parent.parent)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert time.monotonic() < deadline, b"".join(chunks).decode(errors="replace")[-4000:]
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end closed (the process exited)
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


@pytest.mark.fleet
def test_the_live_display_of_specfleet_run_ends_on_the_final_state(fleet: Any) -> None:
    """``specfleet run`` in a terminal: the last frame drawn shows every dataset as summary.json
    says it ended (its rows, "done" and why), not a read from before its last rows landed."""
    import sys

    from tests.fleet import prompts, write_jsonl

    fleet.start_simulator("--latency-median-ms", "300")
    fleet.start_worker("w1", concurrency=40)
    fleet.wait_ready("w1")
    a = write_jsonl(fleet.tmp / "a.jsonl", prompts(200, "a"))
    b = write_jsonl(fleet.tmp / "b.jsonl", prompts(60, "b"))
    config = fleet.write_config([
        {"name": "A_budget", "path": a, "length": "short", "budget_tokens": 30_000},
        {"name": "B_all", "path": b, "length": "short", "budget_tokens": 10_000_000},
    ])
    env = fleet.env(TERM="xterm-256color", COLUMNS="240", LINES="60")
    code, screen = _run_under_a_terminal(
        [sys.executable, "-m", "producer.cli", "run", str(config), "--stall-s", "5", "--yes"], env, timeout_s=180)
    assert code == 0, screen[-4000:]
    _assert_last_frame_is_final(screen, fleet)
    # `specfleet status --watch` on the ended run: it draws the same final state and ends by itself.
    code, screen = _run_under_a_terminal(
        [sys.executable, "-m", "producer.cli", "status", "--watch"], env, timeout_s=60)
    assert code == 0, screen[-4000:]
    _assert_last_frame_is_final(screen, fleet)


def _assert_last_frame_is_final(screen: str, fleet: Any) -> None:
    from tests.fleet import read_summary

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", screen).replace("\r", "\n")
    bars = [line for line in text.split("\n") if "━" in line]
    assert bars, text[-4000:]
    for ds in ("A_budget", "B_all"):
        summary = read_summary(fleet.out, ds)
        last = [line for line in bars if line.startswith(ds)][-1]
        assert f"rows {summary['results']:,} " in last, (last, summary["results"])
        why = {"budget": "budget", "complete": "all prompts"}[summary["end_reason"]]
        assert last.rstrip().endswith(f"done: {why}"), last
        assert "active" not in last and "ETA" not in last, last
    # The fleet's throttle row as the run ended: nothing in flight.
    assert "in flight 0/" in [line for line in bars if line.startswith("upstream")][-1]


def _batch(batch_id: str, status: str, requests: int, age_s: float, completed: int = 0) -> dict[str, Any]:
    return {"intent": batch_id, "dataset": "short", "batch_id": batch_id, "requests": requests, "age_s": age_s,
            "state": "submitted", "status": status, "completed": completed, "failed": 0}


def test_open_batches_show_in_plain_lines_and_live_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch mode: the open batches' count, requests, oldest age and states, as a plain line each
    due batch (and once more when the last one landed) and as one more live row."""
    two = [_batch("batch_a", "in_progress", 1_000, 95.0, completed=400), _batch("batch_b", "validating", 500, 3.0)]
    out = io.StringIO()
    view = ProgressView(["short"], live=False, stream=out)
    view.update([_state(t=0)], None, [])  # none yet: no line
    view.update([_state(t=PLAIN_INTERVAL_S)], None, two)
    view.update([_state(t=PLAIN_INTERVAL_S + 1)], None, two)  # not due
    view.update([_state(t=2 * PLAIN_INTERVAL_S)], None, [])  # landed: said once
    view.update([_state(t=3 * PLAIN_INTERVAL_S)], None, [])
    lines = [line for line in _lines(out) if " batches " in line]
    assert len(lines) == 2, _lines(out)
    assert lines[0].endswith("batches open=2 requests=1500 answered=400 oldest_s=95 states=in_progress:1,validating:1")
    assert lines[1].endswith("batches open=0 requests=0 answered=0 oldest_s=0 states=-")

    monkeypatch.setenv("COLUMNS", "240")  # a wide terminal: rich cuts nothing
    out = io.StringIO()
    view = ProgressView(["short"], live=True, stream=out)
    view.update([_state(t=0)], None, [])
    view.update([_state(t=1)], None, two)
    view.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    final = text[text.rfind("batches") :]
    assert "2 open, 1,500 requests" in final and "oldest 1m35s" in final and "answered 400" in final, final
    assert "in_progress 1, validating 1" in final, final
    out = io.StringIO()
    view = ProgressView(["short"], live=True, stream=out)
    view.update([_state(t=0)], None, None)  # a live-mode run: no batches row
    view.close()
    assert "batches" not in out.getvalue()


def test_a_dataset_with_batches_out_shows_them_beside_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Datasets overlap their tails (issue 36): the one whose admission ended says what it still has
    out while the next one runs; both bars, both plain lines."""
    out_a = [_batch("batch_a", "in_progress", 300, 40.0), _batch("batch_b", "validating", 20, 2.0)]
    out_a = [{**b, "dataset": "A"} for b in out_a] + [{**_batch("batch_c", "validating", 50, 1.0), "dataset": "B"}]
    monkeypatch.setenv("COLUMNS", "240")
    out = io.StringIO()
    view = ProgressView(["A", "B"], live=True, stream=out)
    view.update([_state("A", t=0, kept_tokens=9_000), _state("B", t=0, kept_tokens=100)], None, out_a)
    view.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "active · 2 batches out (320 requests)" in text and "active · 1 batch out (50 requests)" in text, text
    out = io.StringIO()
    view = ProgressView(["A", "B"], live=False, stream=out)
    view.update([_state("A", t=0), _state("B", t=0)], None, out_a)
    lines = _lines(out)
    assert any("dataset=A" in line and line.endswith("batches_out=2") for line in lines), lines
    assert any("dataset=B" in line and line.endswith("batches_out=1") for line in lines), lines
