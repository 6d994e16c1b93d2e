"""The accounting record: every usage counter of a dataset, declared once.

A counter lives in the dataset's stats hash (``DatasetKeys.stats``) under its ``source`` field,
written by budget.lua: from a billed answer's usage with a settle, fail or release (once per lease;
the counters whose ``usage`` names the ``Usage`` key, ``common/stats.answer_counts``) or by a line of
the script itself; or by the workers (``DatasetStats.add``, by name). From ``COUNTERS`` follow,
under the one ``name``: the increments a billed answer carries, the parse of the hash
(``StatsSnapshot``), the producer's state (``DatasetState``), ``summary.json`` (``Summary``), the
report's accounting table and the exporter's ``specfleet_<name>`` series. Adding a counter is its
entry here plus the line that writes it (budget.lua's ``add(stats, …)``, or a worker's
``stats.add(name=…)``); tests/test_accounting.py checks that the script writes only declared
fields and that each counter reaches every one of those places, and that a counter added to this
record alone does.

The classes that carry the counters derive from ``Counted``: a dataclass whose keyword-only fields
are made from ``COUNTERS`` (for the type checker, any counter attribute is ``Any``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

#: Units: a count of events, tokens, or dollars (stored in micro-dollars, an integer for HINCRBY).
COUNT, TOKENS, USD = "count", "tokens", "usd"
_MICRO = 1e6
#: ``Counter.usage`` of a counter that counts billed answers themselves.
PER_ANSWER = "*"


@dataclass(frozen=True)
class Counter:
    #: The one name: attribute, summary.json key, report row, metric ``specfleet_<name>``.
    name: str
    #: The stats hash's field (budget.lua's header lists them).
    source: str
    unit: str
    #: One line: the metric's help and the report's row.
    doc: str
    #: A billed answer's increment, added by budget.lua with its settle, fail or release: the
    #: ``Usage`` key (common/contract.py) it is taken from, ``PER_ANSWER`` (1 per answer), or None
    #: (written elsewhere).
    usage: str | None = None

    def value(self, raw: int) -> int | float:
        """The hash's integer as the counter's value (micro-dollars become dollars)."""
        return raw / _MICRO if self.unit == USD else raw

    def raw(self, value: int | float) -> int:
        """The counter's value as the hash's integer (dollars become micro-dollars, for HINCRBY)."""
        return round(value * _MICRO) if self.unit == USD else int(value)

    @property
    def zero(self) -> int | float:
        return 0.0 if self.unit == USD else 0


COUNTERS: tuple[Counter, ...] = (
    Counter("requests", "requests", COUNT, "Upstream requests sent", usage=PER_ANSWER),
    Counter("billed_prompt_tokens", "billed_prompt_tokens", TOKENS, "Prompt tokens billed by the provider",
            usage="prompt_tokens"),
    Counter("billed_completion_tokens", "billed_completion_tokens", TOKENS, "Completion tokens billed by the provider",
            usage="completion_tokens"),
    Counter("billed_reasoning_tokens", "billed_reasoning_tokens", TOKENS,
            "Reasoning tokens billed (part of completion)", usage="reasoning_tokens"),
    Counter("cost_usd", "cost_micro_usd", USD, "Cost reported by OpenRouter, USD", usage="cost"),
    Counter("duplicates", "duplicates", COUNT, "Second deliveries of an already kept prompt, row dropped"),
    Counter("skipped_by_workers", "skipped", COUNT, "Tasks workers skipped (their dataset not active, or stopped)"),
    Counter("truncated", "truncated", COUNT,
            "Billed answers cut by max_tokens (finish_reason length), kept, separated or dropped", usage="truncated"),
    Counter("engine_rows", "engine_rows", COUNT, "Kept rows whose token ids came from an engine"),
    Counter("engine_mismatch", "engine_mismatch", COUNT,
            "Engine rows whose text rebuild differed from the engine's ids"),
    Counter("engine_prompt_mismatch", "engine_prompt_mismatch", COUNT,
            "Engine rows whose prompt ids differed from the template-rendered prompt"),
    Counter("usage_checked", "usage_checked", COUNT,
            "Kept rows whose billed usage was compared with the fleet's own counts"),
    Counter("usage_mismatch", "usage_mismatch", COUNT,
            "Kept rows billed other token counts than the run's tokenizer gives (beyond the model's offset)"),
    Counter("batch_requests", "batch_requests", COUNT, "Requests submitted in Batch API batches"),
    Counter("batch_results", "batch_results", COUNT, "Batch results settled (rebuilt and counted)"),
    Counter("batch_failed", "batch_failed", COUNT, "Batch requests that failed (an error result, an invalid request)"),
    Counter("batch_returned", "batch_returned", COUNT,
            "Batch requests given back unanswered (an expired or failed batch): asked again"),
    Counter("batch_tail_live", "batch_tail_live", COUNT,
            "Batch-mode rows kept from live requests: the budget's tail (its room under a full batch's worst cases)"),
    Counter("batch_cost_usd", "batch_cost_micro_usd", USD, "What the batches billed (their usage.cost), USD"),
    Counter("batch_rows_cost_usd", "batch_rows_cost_micro_usd", USD,
            "Batch answers at tokens x the batch price, USD (batch_cost_usd minus this: the difference)"),
)

BY_NAME: dict[str, Counter] = {c.name: c for c in COUNTERS}
BY_SOURCE: dict[str, Counter] = {c.source: c for c in COUNTERS}
NAMES: tuple[str, ...] = tuple(c.name for c in COUNTERS)
#: The counters a billed answer carries to budget.lua (``Counter.usage``).
PER_ANSWER_COUNTERS: tuple[Counter, ...] = tuple(c for c in COUNTERS if c.usage is not None)


def parse_counts(counts: dict[str, int]) -> dict[str, int | float]:
    """Every counter's value from the stats hash's fields (absent: zero)."""
    return {c.name: c.value(counts.get(c.source, 0)) for c in COUNTERS}


if TYPE_CHECKING:
    class Counted:
        """The counters as attributes (``COUNTERS``); the type checker sees each as ``Any``."""

        def __getattr__(self, name: str) -> Any: ...

        def counts(self) -> dict[str, Any]: ...
else:
    def _counts(self: Any) -> dict[str, Any]:
        return {c.name: getattr(self, c.name) for c in COUNTERS}

    Counted = make_dataclass(
        "Counted", [(c.name, int | float, field(default=c.zero, kw_only=True)) for c in COUNTERS],
        namespace={"counts": _counts, "__doc__": "The counters as keyword-only fields (``COUNTERS``)."},
    )


def ordered(data: dict[str, Any], cls: type) -> dict[str, Any]:
    """``asdict`` of a ``Counted`` subclass with its own fields first, then the counters in
    ``COUNTERS`` order: the counters follow the record's identity in summary.json."""
    own = [f.name for f in fields(cls) if f.name not in BY_NAME]
    return {**{k: data[k] for k in own}, **{k: data[k] for k in NAMES}}


__all__ = ["BY_NAME", "BY_SOURCE", "COUNTERS", "NAMES", "PER_ANSWER", "PER_ANSWER_COUNTERS", "Counted", "Counter",
           "ordered", "parse_counts"]
