"""Tokens and dollars, spent against their limits, in progress lines, bars, the report line and table."""

from __future__ import annotations

import io

from producer.progress import ProgressView
from producer.report import render_markdown
from producer.summary import Summary, report_line
from tests.test_progress import _state


def test_progress_shows_dollars_against_the_dataset_and_run_limits() -> None:
    out = io.StringIO()
    view = ProgressView(["d"], stream=out)
    view.update([_state("d", kept_tokens=2_500, spent_usd=0.1234, budget_usd=0.5, run_spent_usd=0.2,
                        run_budget_usd=1.0)])
    line = out.getvalue()
    assert "kept_tokens=2500/10000 (25.0%)" in line
    assert "spent_usd=0.1234/0.5 run_spent_usd=0.2000/1.0" in line
    bars = io.StringIO()
    live = ProgressView(["d"], live=True, stream=bars)
    live.update([_state("d", kept_tokens=2_500, spent_usd=0.1234, budget_usd=0.5)])
    live.close()
    assert "$0.12/$0.50" in bars.getvalue()


def test_report_line_and_table_show_tokens_and_dollars() -> None:
    summary = {"dataset": "d", "end_reason": "budget_usd", "tokens": 9_000, "budget_tokens": 10_000_000,
               "results": 12, "skipped": 3, "failed": 0, "malformed": 0, "billed_completion_tokens": 9_100,
               "cost_usd": 0.0412, "spent_usd": 0.0413, "budget_usd": 0.05, "run_budget_usd": 1.0,
               "run_spent_usd": 0.3, "wall_s": 2.0}
    line = report_line(Summary(**{
        "prompts": 15, "results_this_run": 12, "billed_prompt_tokens": 0, "billed_reasoning_tokens": 0,
        "requests": 12, "duplicates": 0, **summary}))
    assert line.startswith("d: dollar budget reached, 9,000 of 10,000,000 tokens · $0.0413 of $0.05 ")
    assert "(run $0.3000 of $1.00)" in line
    md = render_markdown([summary], {})
    assert "| USD budget |" in md and "| 0.0413 | 0.05 |" in md
