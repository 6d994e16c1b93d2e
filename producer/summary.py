"""What a finished dataset reports: the ``Summary`` record (``OUT/<dataset>/summary.json``) and its
one-line form printed at the end of a run.

A field added here reaches summary.json, the CLI's line (if ``report_line`` shows it) and the
report (``producer/report.py`` reads summary.json's keys, so it can be rebuilt offline).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class Summary:
    dataset: str
    #: budget | complete | stalled
    end_reason: str
    #: Good prompts in the file (up to max_prompts).
    prompts: int
    #: Rows kept in all runs of this dataset, and in this run alone.
    results: int
    results_this_run: int
    failed: int
    #: Prompts with neither a row nor a failure (the budget ended first).
    skipped: int
    malformed: int
    #: Kept tokens (the loss-mask ones) against the budget.
    tokens: int
    budget_tokens: int
    billed_prompt_tokens: int
    billed_completion_tokens: int
    billed_reasoning_tokens: int
    cost_usd: float
    requests: int
    duplicates: int
    #: Attempts that failed, by reason, and prompts that failed for good, by reason.
    errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    #: From the start to the first end of admission (top-up rounds come later).
    admission_s: float = 0.0
    #: From the end of admission to the next dataset's first enqueue.
    switch_s: float | None = None
    top_ups: int = 0
    rows_at_first_stop: int | None = None
    enqueue_s: float | None = None
    #: The files holding the rows (for JSONL, the shards).
    shards: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        """A summary.json read back; keys this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def report_line(s: Summary) -> str:
    of_budget = f"{s.tokens:,} of {s.budget_tokens:,} tokens"
    if s.end_reason == "budget":
        head = f"budget reached {of_budget}"
    elif s.end_reason == "complete":
        head = f"all prompts done, {of_budget}"
    else:
        head = f"{s.end_reason}, {of_budget}"
    return (
        f"{s.dataset}: {head} · results {s.results:,} · skipped {s.skipped:,} · "
        f"failed {s.failed:,} · malformed {s.malformed:,} · billed {s.billed_completion_tokens:,} "
        f"completion tokens · ${s.cost_usd:.4f} · {s.wall_s:.1f} s"
    )
