"""What a finished dataset reports: the ``Summary`` record (``OUT/<dataset>/summary.json``) and its
one-line form printed at the end of a run.

The counters (requests, billed tokens, cost …) are the accounting record's (``common/accounting.py``):
declared there, not here. A field added here reaches summary.json, the CLI's line (if ``report_line`` shows it) and the
report (``producer/report.py`` reads summary.json's keys, so it can be rebuilt offline).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from common.accounting import BY_NAME, USD, Counted, ordered
from common.throttle import ThrottleSnapshot


@dataclass
class Summary(Counted):
    """With the counters of the accounting record (``common/accounting.COUNTERS``) under their names."""

    dataset: str
    #: budget (tokens) | budget_usd | run_budget | complete | stalled
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
    #: Good prompts not asked (common/prompt_filter.py): the same prompt as an earlier one of the run
    #: (``[run] duplicates``), and eval leaks (``[run] exclude``, named in excluded.jsonl).
    duplicate_prompts: int = 0
    excluded: int = 0
    #: ``duplicates = "share"``: duplicates given their first copy's rows (shared.jsonl: the rows,
    #: the prompts), and those whose first copy has no kept row (not kept).
    shared_rows: int = 0
    shared_prompts: int = 0
    shared_not_kept: int = 0
    #: Messages refused from the dataset's queue (not its prompts: a dead-letter list's entries).
    dead_letters: int = 0
    #: hard: never over a budget; projected: tokens admitted on an estimate (see common/budget.py).
    budget_mode: str = "hard"
    #: Dollars: the dataset's limit (None: none) and what it spent, kept or not; dollars still held
    #: for requests whose worker vanished (they may have been billed); the run's limit and spend.
    budget_usd: float | None = None
    spent_usd: float = 0.0
    unresolved_usd: float = 0.0
    run_budget_usd: float | None = None
    run_spent_usd: float = 0.0
    #: Attempts that failed, by reason, and prompts that failed for good, by reason.
    errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    #: The fleet-wide upstream throttle when the dataset ended (``throttle_summary``).
    throttle: dict[str, Any] | None = None
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
    #: ``all``: every assistant turn regenerated: ``prompts`` are conversations, ``results`` rows
    #: (one per kept turn), ``failed`` conversations ended by a failed turn, ``skipped`` conversations
    #: without an outcome (the budget ended first; ``conversations_partial`` of them keep some turns).
    regenerate: str = "last"
    #: Conversations whose turns were all kept, or that ended at a kept turn calling tools.
    conversations_ended: int | None = None
    conversations_partial: int | None = None
    #: Kept turns per conversation (a histogram: turns -> conversations, those with at least one).
    turns_per_conversation: dict[str, int] = field(default_factory=dict)
    #: The rows' provider mix: ``"<provider>|<quantization>"`` -> rows in the folder (all runs), and
    #: the warning when more than one provider or quantization served them (``producer/provenance.py``).
    providers: dict[str, int] = field(default_factory=dict)
    provider_warning: str | None = None
    #: Where rows cut by max_tokens went (``[request] truncated``), and how many the folder holds or
    #: dropped (all runs; the ``truncated`` counter is this run's billed answers cut, kept or not).
    truncated_policy: str = "keep"
    truncated_rows: int = 0
    #: Where rows marked degenerate went (``[request] degenerate``), and how many the folder holds or
    #: dropped by reason (``repetition``, ``empty_content``, ``unclosed_reasoning``; all runs).
    degenerate_policy: str = "keep"
    degenerate_rows: dict[str, int] = field(default_factory=dict)
    #: ``[[datasets]] sampling``: recipe -> rows and kept tokens in the folder (all runs).
    recipe_rows: dict[str, int] = field(default_factory=dict)
    recipe_tokens: dict[str, int] = field(default_factory=dict)
    #: ``[model] engine_prompt_mismatch = "warn"``: the warning when kept rows carry prompt ids the
    #: run's tokenizer does not render (the engine serves another chat template).
    engine_prompt_warning: str | None = None
    #: The warning when kept rows were billed other token counts than the run's tokenizer gives
    #: (``usage_mismatch``, common/usage_check.py): their ids may not be the model's.
    usage_warning: str | None = None

    def to_json(self) -> dict[str, Any]:
        return ordered(asdict(self), Summary)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        """A summary.json read back; keys this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def engine_prompt_warning(s: Summary) -> str | None:
    """The warning for a dataset whose engine rows' prompt ids are not the rendered prompt's."""
    mismatched, rows = int(s.engine_prompt_mismatch or 0), int(s.engine_rows or 0)
    if not mismatched:
        return None
    return (f"{mismatched:,} of {rows:,} engine rows have prompt ids unlike the run tokenizer's chat template "
            "(the engine serves another one; kept: engine_prompt_mismatch = \"warn\")")


def usage_warning(s: Summary) -> str | None:
    """The warning for a dataset whose kept rows disagree with their billed usage (``usage_check``)."""
    mismatched, checked = int(s.usage_mismatch or 0), int(s.usage_checked or 0)
    if not mismatched:
        return None
    return (f"{mismatched:,} of {checked:,} checked rows ({mismatched / checked:.2%}) were billed other token counts "
            "than the run's tokenizer gives (rows flagged usage_check.match = false): check [model] tokenizer")


def summary_counts(counted: Counted) -> dict[str, Any]:
    """The counters as summary.json keeps them: dollars to the micro-dollar the hash counts in."""
    return {k: round(v, 6) if BY_NAME[k].unit == USD else v for k, v in counted.counts().items()}


_HEADS = {"budget": "budget reached", "budget_usd": "dollar budget reached",
          "run_budget": "run dollar budget reached", "complete": "all prompts done"}


def report_line(s: Summary) -> str:
    head = f"{_HEADS.get(s.end_reason, s.end_reason)}, {s.tokens:,} of {s.budget_tokens:,} tokens"
    dollars = f"${s.spent_usd or s.cost_usd:.4f}" + (f" of ${s.budget_usd:.2f}" if s.budget_usd else "")
    if s.run_budget_usd:
        dollars += f" (run ${s.run_spent_usd:.4f} of ${s.run_budget_usd:.2f})"
    if s.regenerate == "all":
        turns = " ".join(f"{k}:{v:,}" for k, v in sorted(s.turns_per_conversation.items(), key=lambda kv: int(kv[0])))
        return (
            f"{s.dataset}: {head} · {dollars} · conversations {s.prompts:,} (ended {s.conversations_ended or 0:,}, "
            f"partial {s.conversations_partial or 0:,}, failed {s.failed:,}, skipped {s.skipped:,}) · rows "
            f"{s.results:,} · turns per conversation {turns or '-'} · malformed {s.malformed:,} · billed "
            f"{s.billed_completion_tokens:,} completion tokens · {s.wall_s:.1f} s"
        )
    return (
        f"{s.dataset}: {head} · {dollars} · results {s.results:,} · skipped {s.skipped:,} · "
        f"failed {s.failed:,} · malformed {s.malformed:,} · billed {s.billed_completion_tokens:,} "
        f"completion tokens · {s.wall_s:.1f} s"
        + (f" · 429s {100 * s.throttle['throttled_share']:.1f}%" if s.throttle else "")
        + (f" · dead letters {s.dead_letters:,} (not prompts: `specfleet status`)" if s.dead_letters else "")
        + (f" · truncated {s.truncated_rows:,} ({s.truncated_policy})" if s.truncated_rows else "")
        + (f" · duplicates {s.duplicate_prompts:,} not asked" if s.duplicate_prompts else "")
        + (f" ({s.shared_prompts:,} shared, {s.shared_not_kept:,} not kept)" if s.shared_prompts or s.shared_not_kept
           else "")
        + (f" · excluded {s.excluded:,} (eval sets)" if s.excluded else "")
        + (f" · degenerate {sum(s.degenerate_rows.values()):,} ({s.degenerate_policy})" if s.degenerate_rows else "")
    )


def throttle_summary(t: ThrottleSnapshot) -> dict[str, Any]:
    """The fleet's throttle when a dataset ends: its in-flight limit then (None: unbounded) and the
    two it is the lower of (``capacity_limit`` learned from 429s, ``balance_limit`` the worst cases
    the balance covers; None: unbounded, unknown), the upstream answers so far by kind (the fleet's
    counters, reset when the run started: ``budget_refused`` the account's in-flight budget 402s)
    and the 429 share learned as the provider's background (refused whatever the load)."""
    def rounded(x: float | None) -> float | None:
        return None if x is None else round(x, 1)

    return {"limit": rounded(t.limit), "capacity_limit": rounded(t.capacity_limit),
            "balance_limit": rounded(t.balance_limit), "ok": t.ok, "throttled": t.throttled,
            "throttled_share": round(t.throttled_share, 4), "background_share": round(t.background_share, 4),
            "budget_refused": t.budget_refused}
