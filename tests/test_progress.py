"""Progress view: plain lines when not a terminal (throttled), bars when live, rate and ETA maths."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest

from producer.progress import PLAIN_INTERVAL_S, ProgressView, TokenRate, eta_s, fmt_duration, fmt_tokens
from producer.state import DatasetState

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
