"""The end-of-run report: ``OUT/report.md`` (one table row per dataset) and ``OUT/report.png``.

Inputs are plain data so the report can be rebuilt offline: the per-dataset ``summary.json`` dicts
(or the run's ``Summary`` records) and the progress timelines (``DatasetState.to_json()`` samples).
Missing keys render as "-" rather than failing: a report of a crashed or partial run is still worth
writing.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Agg through the object API: no pyplot global state, no display, safe off the main thread.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, PercentFormatter

from common.accounting import COUNTERS, USD
from common.manifest import MANIFEST
from producer.progress import fmt_duration, fmt_tokens
from producer.summary import Summary

REPORT_MD = "report.md"
REPORT_PNG = "report.png"

#: Smoothing window of the throughput plot, as a fraction of the run's span (min 10 s): raw
#: per-sample rates jump with every long row and hide the trend.
_RATE_WINDOW_FRACTION = 1 / 40
_MIN_RATE_WINDOW_S = 10.0

_COLUMNS = [
    "dataset",
    "end reason",
    "results",
    "failed",
    "skipped",
    "malformed",
    "kept tokens",
    "budget",
    "budget used",
    "duplicates",
    "excluded",
    "billed prompt",
    "billed completion",
    "billed/kept",
    "cost (USD)",
    "USD budget",
    "wall",
    "rows/s",
]


def write_report(
    out_dir: Path, summaries: Sequence[Summary | dict[str, Any]], timelines: dict[str, list[dict[str, Any]]]
) -> Path:
    """Writes report.md and report.png into ``out_dir``; returns the path of report.md."""
    plain = [s.to_json() if isinstance(s, Summary) else s for s in summaries]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / REPORT_PNG
    _write_png(png, plain, timelines)
    md = out_dir / REPORT_MD
    tmp = md.with_suffix(".md.tmp")
    manifest = _manifest(out_dir)
    tmp.write_text(render_markdown(plain, timelines, png_name=png.name, manifest=manifest), encoding="utf-8")
    tmp.replace(md)  # a reader never sees half a report
    return md


# --- markdown -----------------------------------------------------------------------------------


def _num(summary: dict[str, Any], key: str) -> float | None:
    value = summary.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _int_cell(value: float | None) -> str:
    return "-" if value is None else f"{int(value):,}"


def _ratio(num: float | None, den: float | None, fmt: str) -> str:
    if num is None or not den:
        return "-"
    return format(num / den, fmt)


def table_row(summary: dict[str, Any]) -> list[str]:
    """The cells of one dataset's row, in ``_COLUMNS`` order."""
    results = _num(summary, "results")
    tokens = _num(summary, "tokens")
    budget = _num(summary, "budget_tokens")
    completion = _num(summary, "billed_completion_tokens")
    cost = _num(summary, "spent_usd")
    cost = _num(summary, "cost_usd") if cost is None else cost
    wall = _num(summary, "wall_s")
    return [
        str(summary.get("dataset", "?")),
        str(summary.get("end_reason") or "-"),
        _int_cell(results),
        _int_cell(_num(summary, "failed")),
        _int_cell(_num(summary, "skipped")),
        _int_cell(_num(summary, "malformed")),
        _int_cell(tokens),
        _int_cell(budget),
        "-" if tokens is None or not budget else f"{100 * tokens / budget:.1f}%",
        # Prompts not asked: the same as an earlier one of the run (shared: rows given), eval leaks.
        _int_cell(_num(summary, "duplicate_prompts"))
        + (f" ({int(shared):,} shared)" if (shared := _num(summary, "shared_prompts")) else ""),
        _int_cell(_num(summary, "excluded")),
        _int_cell(_num(summary, "billed_prompt_tokens")),
        _int_cell(completion),
        _ratio(completion, tokens, ".2f"),
        "-" if cost is None else f"{cost:.4f}",
        "-" if (usd := _num(summary, "budget_usd")) is None else f"{usd:.2f}",
        "-" if wall is None else fmt_duration(wall),
        _ratio(results, wall, ".2f"),
    ]


def _totals(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"dataset": "**total**", "end_reason": ""}
    for key in (
        "results",
        "failed",
        "skipped",
        "malformed",
        "duplicate_prompts",
        "shared_prompts",
        "excluded",
        "tokens",
        "budget_tokens",
        "billed_prompt_tokens",
        "billed_completion_tokens",
        "cost_usd",
        "spent_usd",
        "budget_usd",
        "wall_s",  # datasets run one after another: the run's wall time is the sum
    ):
        values = [v for s in summaries if (v := _num(s, key)) is not None]
        if values:
            total[key] = sum(values)
    return total


def _md_table(rows: list[list[str]]) -> list[str]:
    right = {i for i, c in enumerate(_COLUMNS) if c not in ("dataset", "end reason")}
    align = ["---:" if i in right else "---" for i in range(len(_COLUMNS))]
    lines = ["| " + " | ".join(_COLUMNS) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def _breakdown(title: str, key: str, timelines: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Counts by class from each dataset's last timeline sample (``errors`` / ``failures``)."""
    lines = []
    for ds, samples in timelines.items():
        counts = samples[-1].get(key) if samples else None
        if isinstance(counts, dict) and counts:
            parts = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
            lines.append(f"- **{ds}**: {parts}")
    return [f"## {title}", "", *lines, ""] if lines else []


def _throttle_section(summaries: list[dict[str, Any]]) -> list[str]:
    """The fleet-wide throttle as each dataset ended: its in-flight limit and the share of upstream
    answers that were 429/503 (``summary["throttle"]``, the run's counts up to then)."""
    lines = []
    for s in summaries:
        t = s.get("throttle")
        if not isinstance(t, dict):
            continue
        limit = t.get("limit")
        answers = int(t.get("ok") or 0) + int(t.get("throttled") or 0)
        lines.append(
            f"- **{s.get('dataset', '?')}**: in-flight limit "
            f"{'unbounded (no 429 yet, no cap)' if limit is None else f'{limit:,.0f}'} · "
            f"429s {100 * float(t.get('throttled_share') or 0):.2f}% "
            f"({int(t.get('throttled') or 0):,} of {answers:,} upstream answers)"
        )
    return ["## Upstream throttle (whole fleet)", "", *lines, ""] if lines else []


def _engine_ids(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Datasets whose rows carry an engine's ids: how often the text rebuild disagreed with them."""
    lines = []
    for s in summaries:
        rows = _num(s, "engine_rows")
        if not rows:
            continue
        wrong, prompts = _num(s, "engine_mismatch") or 0, _num(s, "engine_prompt_mismatch") or 0
        lines.append(
            f"- **{s.get('dataset', '?')}**: {int(rows):,} rows with the engine's ids; `engine_mismatch` "
            f"{int(wrong):,} ({wrong / rows:.2%} of them: text-only rebuilding would have been wrong); "
            f"prompt ids unlike the template-rendered prompt: {int(prompts):,} ({prompts / rows:.2%})"
            + (f" · **warning**: {s['engine_prompt_warning']}" if s.get("engine_prompt_warning") else "")
        )
    if not lines:
        return []
    note = ("A prompt-ids difference means the engine serves another chat template than the run's "
            "tokenizer: check the configuration.")
    return ["## Engine ids", "", *lines, "", note, ""]


def _usage_check(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Each dataset's rows whose billed usage was compared with their own counts, and how many disagreed."""
    lines = []
    for s in summaries:
        checked = _num(s, "usage_checked")
        if not checked:
            continue
        wrong = _num(s, "usage_mismatch") or 0
        lines.append(f"- **{s.get('dataset', '?')}**: {int(checked):,} rows checked; `usage_mismatch` {int(wrong):,} "
                     f"({wrong / checked:.2%})" + (f" · **warning**: {s['usage_warning']}" if s.get("usage_warning")
                                                    else ""))
    if not lines:
        return []
    note = ("Each kept row's billed prompt and completion tokens against its own ids, allowing the model's known "
            "difference (`[model] usage_offset`, or learned from the first answers). A mismatch means its ids are "
            "not what the model read or wrote: another tokenizer revision or chat template.")
    return ["## Billed usage against the rows' ids", "", *lines, "", note, ""]


def _accounting(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Every counter of the accounting record (``common/accounting.COUNTERS``) of each dataset, as
    summary.json counted it, so the table above hides none; their meanings below."""
    lines = []
    for s in summaries:
        cells = []
        for c in COUNTERS:
            v = _num(s, c.name)
            cells.append(f"`{c.name}` " + ("-" if v is None else f"{v:.6f}" if c.unit == USD else f"{int(v):,}"))
        lines.append(f"- **{s.get('dataset', '?')}**: " + " · ".join(cells))
    if not lines:
        return []
    meanings = "; ".join(f"`{c.name}`: {c.doc}" for c in COUNTERS)
    return ["## Accounting (summary.json's counters)", "", *lines, "", meanings + ".", ""]


def _conversations(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Datasets with ``regenerate = "all"``: rows are turns, prompts are conversations."""
    lines = []
    for s in summaries:
        if s.get("regenerate") != "all":
            continue
        per = s.get("turns_per_conversation") or {}
        turns = ", ".join(f"{k} turns: {int(v):,}" for k, v in sorted(per.items(), key=lambda kv: int(kv[0])))
        lines.append(
            f"- **{s.get('dataset', '?')}**: {int(_num(s, 'prompts') or 0):,} conversations, "
            f"{int(_num(s, 'results') or 0):,} rows (one per kept turn); ended "
            f"{int(_num(s, 'conversations_ended') or 0):,}, failed {int(_num(s, 'failed') or 0):,}, without an "
            f"outcome {int(_num(s, 'skipped') or 0):,} (with some turns kept: "
            f"{int(_num(s, 'conversations_partial') or 0):,}); "
            f"kept turns per conversation: {turns or 'none'}"
        )
    return ["## Conversations (every turn regenerated)", "", *lines, ""] if lines else []


def _manifest(out_dir: Path) -> dict[str, Any] | None:
    """``OUT/manifest.json`` as plain data (None: absent or unreadable: the report is still written)."""
    try:
        data = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _provenance(summaries: Sequence[dict[str, Any]], manifest: dict[str, Any] | None) -> list[str]:
    """What made the rows (the manifest's summary) and, per dataset, who served them and the rows
    cut by max_tokens."""
    lines: list[str] = []
    if manifest is not None:
        tok = manifest.get("tokenizer") or {}
        files = tok.get("files") or {}
        file_list = ", ".join(f"`{name}` {str(sha)[:12]}" for name, sha in sorted(files.items()))
        template = str(manifest.get("chat_template_sha256") or "-")[:12]
        lines += [
            f"- manifest `{manifest.get('manifest_id', '?')}` (manifest.json; every row's `manifest`) · specfleet "
            f"{manifest.get('specfleet_version', '?')} · {manifest.get('started_at', '?')} → "
            f"{manifest.get('ended_at') or 'running'}",
            f"- model `{manifest.get('model', '?')}` · tokenizer `{tok.get('source', '?')}` revision "
            f"{tok.get('revision') or '-'} ({file_list or 'no files'}) · chat template sha256 {template}",
            f"- providers `{manifest.get('providers_policy', '?')}`, preferences "
            f"`{json.dumps(manifest.get('provider'), sort_keys=True)}` · truncated rows "
            f"`{manifest.get('truncated_policy', '?')}` · request "
            f"`{json.dumps(manifest.get('request'), sort_keys=True)}`",
        ]
    for s in summaries:
        mix = s.get("providers") or {}
        shown = ", ".join(f"{k} {int(v):,}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1])) or "no rows"
        cut = int(_num(s, "truncated_rows") or 0)
        lines.append(f"- **{s.get('dataset', '?')}**: rows by provider|quantization: {shown} · truncated "
                     f"(finish_reason length) {cut:,} rows, `{s.get('truncated_policy', 'keep')}`"
                     + (f" · **warning**: {s['provider_warning']}" if s.get("provider_warning") else ""))
        if degenerate := s.get("degenerate_rows") or {}:
            kinds = ", ".join(f"{k} {int(v):,}" for k, v in sorted(degenerate.items()))
            lines.append(f"  - degenerate rows (`quality`): {kinds}, `{s.get('degenerate_policy', 'keep')}`")
        if recipes := s.get("recipe_tokens") or {}:
            rows_of = s.get("recipe_rows") or {}
            shown = ", ".join(f"`{k}` {int(v):,} tokens ({int(rows_of.get(k, 0)):,} rows)"
                              for k, v in sorted(recipes.items()))
            lines.append(f"  - kept tokens by sampling recipe: {shown}")
    if manifest is not None and (read := manifest.get("distillation")):
        allowed = {True: "allowed", False: "NOT allowed", None: "not stated"}[read.get("is_trainable_text")]
        lines.append(f"- distillation: {allowed} by the model's author (`is_trainable_text` at "
                     f"{read.get('source') or '-'}, read {read.get('read_at') or 'never'}) · requests enforced it: "
                     f"{'yes' if read.get('enforce_distillable_text') else 'no'}"
                     + (" · the owner went on without it (`allow_non_distillable`)" if read.get("allow_non_distillable")
                        else ""))
    return ["## Provenance", "", *lines, ""] if lines else []


def render_markdown(
    summaries: list[dict[str, Any]], timelines: dict[str, list[dict[str, Any]]], *, png_name: str = REPORT_PNG,
    manifest: dict[str, Any] | None = None,
) -> str:
    rows = [table_row(s) for s in summaries]
    if len(summaries) > 1:
        rows.append(table_row(_totals(summaries)))
    lines = [
        "# specfleet run report",
        "",
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}.",
        "",
        *_md_table(rows),
        "",
        "*kept tokens*: tokens the budget counts (the `loss_mask` ones of kept rows). "
        "*billed/kept*: billed completion tokens (reasoning included) per kept token; above 1 it "
        "measures tokens paid for but not kept (failed, duplicate, over-budget or reasoning "
        "tokens).",
        "",
        f"![budget consumption and throughput over time]({png_name})",
        "",
        *_provenance(summaries, manifest),
        *_conversations(summaries),
        *_throttle_section(summaries),
        *_engine_ids(summaries),
        *_usage_check(summaries),
        *_accounting(summaries),
        *_breakdown("Upstream errors by class", "errors", timelines),
        *_breakdown("Failures by reason", "failures", timelines),
    ]
    return "\n".join(lines).rstrip() + "\n"


# --- plot ---------------------------------------------------------------------------------------


def _series(samples: list[dict[str, Any]]) -> tuple[list[float], list[float], list[float]]:
    """(t_s, kept tokens, budget) of the usable samples, in time order."""
    points = sorted(
        (float(s["t_s"]), float(s.get("kept_tokens") or 0), float(s.get("limit") or 0))
        for s in samples
        if isinstance(s.get("t_s"), int | float)
    )
    return [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]


def smoothed_rate(t: list[float], kept: list[float], window_s: float) -> list[float]:
    """Kept tokens/s at each sample, over the samples in the preceding ``window_s``."""
    rates, j = [], 0
    for i in range(len(t)):
        while t[i] - t[j] > window_s:
            j += 1
        lo = j if j < i else max(0, i - 1)
        dt = t[i] - t[lo]
        rates.append(max(0.0, (kept[i] - kept[lo]) / dt) if dt > 0 else 0.0)
    return rates


def _write_png(path: Path, summaries: list[dict[str, Any]], timelines: dict[str, list[dict[str, Any]]]) -> None:
    budgets = {str(s.get("dataset")): _num(s, "budget_tokens") for s in summaries}
    series = {ds: _series(samples) for ds, samples in timelines.items()}
    series = {ds: s for ds, s in series.items() if s[0]}
    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    budget_ax, rate_ax = fig.subplots(2, 1, sharex=True)
    if not series:
        for ax in (budget_ax, rate_ax):
            ax.text(0.5, 0.5, "no timeline samples", ha="center", va="center", transform=ax.transAxes)
        fig.savefig(path)
        return

    t0 = min(s[0][0] for s in series.values())
    span = max(s[0][-1] for s in series.values()) - t0
    # Minutes read better than thousands of seconds; hours beyond a few of them.
    unit, scale = ("h", 3600.0) if span > 3 * 3600 else ("min", 60.0) if span > 300 else ("s", 1.0)
    window = max(_MIN_RATE_WINDOW_S, span * _RATE_WINDOW_FRACTION)
    for ds, (t, kept, limits) in series.items():
        x = [(ti - t0) / scale for ti in t]
        limit = limits[-1] or budgets.get(ds) or 0
        if limit:
            used = [100 * k / limit for k in kept]
            (line,) = budget_ax.plot(x, used, label=f"{ds} ({fmt_tokens(limit)} tok budget)", lw=1.8)
        else:
            (line,) = budget_ax.plot(x, [0.0] * len(x), label=f"{ds} (no budget)", lw=1.8)
        rate_ax.plot(x, smoothed_rate(t, kept, window), color=line.get_color(), lw=1.5, label=ds)

    budget_ax.axhline(100, color="0.3", ls="--", lw=1)
    budget_ax.set_ylim(0, 110)
    budget_ax.yaxis.set_major_formatter(PercentFormatter())
    budget_ax.set_ylabel("budget used (kept / budget)")
    budget_ax.set_title("Budget consumption per dataset")
    budget_ax.legend(loc="upper left", fontsize="small")
    rate_ax.set_ylabel("kept tokens / s")
    # Plain numbers up to 10k: "1.00k" next to "800" on one axis reads like a different unit.
    rate_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v < 1e4 else fmt_tokens(v)))
    rate_ax.set_ylim(bottom=0)
    rate_ax.set_title(f"Throughput (kept tokens/s, {fmt_duration(window)} moving window)")
    rate_ax.set_xlabel(f"time since run start ({unit})")
    rate_ax.legend(loc="upper left", fontsize="small")
    for ax in (budget_ax, rate_ax):
        ax.grid(True, alpha=0.3)
    fig.savefig(path)
