"""A read of one dataset's progress from Redis: what progress bars, metrics, status and reports show.

Reads only; a few pipelined commands, cheap enough to call every second.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from common.accounting import Counted, ordered
from common.budget import SNAPSHOT_COMMANDS, parse_snapshot, queue_snapshot
from common.keys import CURRENT_RUN, DEAD_LETTER_COUNTS, DatasetKeys
from common.stats import DatasetStats


@dataclass
class DatasetState(Counted):
    """The budget's snapshot (``common/budget.BudgetSnapshot.for_state``: its totals under these
    names), the queue and the counters (``common/accounting.COUNTERS``)."""

    dataset: str
    t_s: float
    limit: int
    kept_tokens: int
    reserved_tokens: int
    rows: int
    failed: int
    in_flight: int
    queued: int
    state: str  # active | exhausted | stopped | "" (not started)
    #: hard | projected; the limit that exhausted admission (tokens, usd, run_usd) or "".
    budget_mode: str = ""
    ended_by: str = ""
    #: Dollars as the budget counts them (every billed answer, kept or not); limits 0 = none.
    budget_usd: float = 0.0
    spent_usd: float = 0.0
    #: Worst-case dollars of requests in flight, and of reaped ones that may still be billed.
    held_usd: float = 0.0
    unresolved_usd: float = 0.0
    run_budget_usd: float = 0.0
    run_spent_usd: float = 0.0
    #: Upstream errors by class (``http_429``, ``timeout`` …) and final failures by reason.
    errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    #: Messages workers refused from the dataset's queue, in all runs (workers/fleet/poison.py): none of
    #: them is one of its prompts.
    dead_letters: int = 0

    @property
    def budget_fraction(self) -> float:
        return self.kept_tokens / self.limit if self.limit else 0.0

    def to_json(self) -> dict[str, Any]:
        return ordered(asdict(self), DatasetState)


def read_state(client: redis.Redis, dataset: str) -> DatasetState:
    k = DatasetKeys(dataset)
    pipe = client.pipeline(transaction=False)
    queue_snapshot(pipe, dataset)
    pipe.hlen(k.failed)
    pipe.llen(k.queue)
    pipe.hgetall(k.stats)
    pipe.hget(DEAD_LETTER_COUNTS, k.queue)
    replies = pipe.execute()
    b = parse_snapshot(replies)
    failed, queued, stats_raw, dead_letters = replies[SNAPSHOT_COMMANDS:]
    stats = DatasetStats.parse(stats_raw)
    return DatasetState(
        dataset=dataset,
        t_s=time.time(),
        failed=int(failed),
        queued=int(queued),
        **b.for_state(),
        **stats.counts(),
        errors=stats.errors,
        failures=stats.failures,
        dead_letters=int(dead_letters or 0),
    )


def current_run(client: redis.Redis) -> dict[str, Any] | None:
    raw = client.get(CURRENT_RUN)
    return json.loads(raw) if raw else None


def read_timeline(client: redis.Redis, dataset: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.lrange(DatasetKeys(dataset).timeline, 0, -1)]
