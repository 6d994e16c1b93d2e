"""A dataset's files: malformed.jsonl once its file is read, then, once it has drained,
failed.jsonl and summary.json (the ``Summary`` built from its last state)."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

from common import keys
from common.contract import conversation_of
from common.errors import DatasetRowError
from producer.dataset_run import DatasetRun
from producer.provenance import read_mix
from producer.rows import atomic_write
from producer.state import DatasetState
from producer.summary import Summary, engine_prompt_warning, report_line, summary_counts, usage_warning

log = logging.getLogger(__name__)

#: Malformed rows named in the log; malformed.jsonl has them all.
LOGGED_MALFORMED = 20


def dataset_dir(out_dir: Path, run: DatasetRun) -> Path:
    path = out_dir / run.name
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_malformed(out_dir: Path, run: DatasetRun, errors: list[DatasetRowError]) -> None:
    for err in errors[:LOGGED_MALFORMED]:
        log.warning("%s", err)
    if len(errors) > LOGGED_MALFORMED:
        log.warning("%s: … and %d more malformed rows (see malformed.jsonl)", run.name, len(errors) - LOGGED_MALFORMED)
    lines = [json.dumps({"where": e.where, "reason": e.reason}, ensure_ascii=False) for e in errors]
    atomic_write(dataset_dir(out_dir, run) / "malformed.jsonl", "".join(x + "\n" for x in lines))


def write_excluded(out_dir: Path, run: DatasetRun, excluded: list[dict[str, Any]]) -> None:
    """The prompts left out as eval leaks, each with the eval item and the run of words it shares."""
    if excluded:
        log.warning("%s: %d prompts share a run of words with an eval set and are not asked (excluded.jsonl)",
                    run.name, len(excluded))
    lines = [json.dumps(x, ensure_ascii=False) for x in excluded]
    atomic_write(dataset_dir(out_dir, run) / "excluded.jsonl", "".join(x + "\n" for x in lines))


def build_summary(run: DatasetRun, st: DatasetState, failures: dict[str, Any], *, run_budget_usd: float | None,
                  throttle: dict[str, Any], shards: list[str],
                  conversations: tuple[int, Counter[str]] | None = None) -> Summary:
    """``conversations``: for ``regenerate = "all"``, the ended conversations and kept turns per
    conversation (``conversation_counts``)."""
    assert run.end_reason is not None, run.phase
    wall_s = (run.finished_s or time.time()) - run.started_s
    results = st.rows
    summary = Summary(
        dataset=run.name,
        end_reason=run.end_reason.value,
        prompts=run.prompts,
        results=results,
        results_this_run=results - run.resumed_rows,
        failed=len(failures),
        skipped=max(0, run.prompts - results - len(failures)),
        malformed=run.malformed,
        duplicate_prompts=run.duplicate_prompts,
        excluded=run.excluded,
        shared_rows=run.shared.rows if run.shared else 0,
        shared_prompts=run.shared.prompts if run.shared else 0,
        shared_not_kept=run.shared.not_kept if run.shared else 0,
        tokens=st.kept_tokens,
        budget_tokens=st.limit,
        **summary_counts(st),
        budget_mode=st.budget_mode,
        budget_usd=run.cfg.budget_usd,
        spent_usd=round(st.spent_usd, 9),
        unresolved_usd=round(st.unresolved_usd, 9),
        run_budget_usd=run_budget_usd,
        run_spent_usd=round(st.run_spent_usd, 9),
        dead_letters=st.dead_letters,
        errors=st.errors,
        failures=st.failures,
        throttle=throttle,
        wall_s=round(wall_s, 3),
        admission_s=round((run.first_stop_s or time.time()) - run.started_s, 3),
        switch_s=None if run.switch_s is None else round(run.switch_s, 3),
        top_ups=run.top_ups,
        rows_at_first_stop=run.rows_at_first_stop,
        enqueue_s=None if run.enqueue_s is None else round(run.enqueue_s, 3),
        shards=shards,
    )
    if conversations is not None:
        ended, per_conversation = conversations
        summary.regenerate = "all"
        summary.conversations_ended = ended
        summary.conversations_partial = max(0, len(per_conversation) - ended - len(failures))
        summary.skipped = max(0, run.prompts - ended - len(failures))
        summary.turns_per_conversation = {str(n): c for n, c in sorted(Counter(per_conversation.values()).items())}
    return summary


def finalize(client: redis.Redis, out_dir: Path, run: DatasetRun, st: DatasetState, *,
             run_budget_usd: float | None, throttle: dict[str, Any], shards: list[str],
             quantizations: dict[str, str] | None = None, truncated_policy: str = "keep",
             degenerate_policy: str = "keep") -> Summary:
    """failed.jsonl and summary.json of a drained dataset; the summary's line logged, and a warning
    when more than one provider or quantization served its rows."""
    folder = dataset_dir(out_dir, run)
    failures = run.budget.failures()
    lines = [json.dumps({"id": pid, **f}, ensure_ascii=False) for pid, f in sorted(failures.items())]
    atomic_write(folder / "failed.jsonl", "".join(x + "\n" for x in lines))
    conversations = conversation_counts(client, run.budget.keys) if run.cfg.regenerate == "all" else None
    summary = build_summary(run, st, failures, run_budget_usd=run_budget_usd, throttle=throttle, shards=shards,
                            conversations=conversations)
    mix = read_mix(folder, quantizations)
    summary.providers, summary.truncated_rows = mix.providers, mix.truncated_rows
    summary.provider_warning, summary.truncated_policy = mix.warning(), truncated_policy
    summary.degenerate_policy, summary.degenerate_rows = degenerate_policy, mix.degenerate
    summary.recipe_rows, summary.recipe_tokens = mix.recipe_rows, mix.recipe_tokens
    if summary.provider_warning:
        log.warning("%s: %s", run.name, summary.provider_warning)
    summary.engine_prompt_warning = engine_prompt_warning(summary)
    if summary.engine_prompt_warning:
        log.warning("%s: %s", run.name, summary.engine_prompt_warning)
    summary.usage_warning = usage_warning(summary)
    if summary.usage_warning:
        log.warning("%s: %s", run.name, summary.usage_warning)
    atomic_write(folder / "summary.json", summary.dumps())
    log.info("%s", report_line(summary))
    return summary


def conversation_counts(client: redis.Redis, k: keys.DatasetKeys) -> tuple[int, Counter[str]]:
    """Ended conversations, and kept turns per conversation (from the turns' keys alone)."""
    per_conversation: Counter[str] = Counter()
    for key in client.hkeys(k.turns):
        per_conversation[conversation_of(key.decode())] += 1
    return int(client.scard(k.ended)), per_conversation
