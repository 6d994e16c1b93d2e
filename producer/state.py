"""A read of one dataset's progress from Redis: what progress bars, metrics, status and reports show.

Reads only; a few pipelined commands, cheap enough to call every second.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from common.keys import CURRENT_RUN, DatasetKeys
from common.stats import DatasetStats


@dataclass
class DatasetState:
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
    requests: int
    billed_prompt_tokens: int
    billed_completion_tokens: int
    billed_reasoning_tokens: int
    cost_usd: float
    duplicates: int
    skipped_by_workers: int
    #: Upstream errors by class (``http_429``, ``timeout`` …) and final failures by reason.
    errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)

    @property
    def budget_fraction(self) -> float:
        return self.kept_tokens / self.limit if self.limit else 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_state(client: redis.Redis, dataset: str) -> DatasetState:
    k = DatasetKeys(dataset)
    pipe = client.pipeline(transaction=False)
    pipe.hmget(k.budget, "limit", "kept", "reserved", "rows", "state")
    pipe.hlen(k.failed)
    pipe.hlen(k.leases)
    pipe.llen(k.queue)
    pipe.hgetall(k.stats)
    (limit, kept, reserved, rows, state), failed, leases, queued, stats_raw = pipe.execute()
    stats = DatasetStats.parse(stats_raw)
    return DatasetState(
        dataset=dataset,
        t_s=time.time(),
        limit=int(limit or 0),
        kept_tokens=int(kept or 0),
        reserved_tokens=int(reserved or 0),
        rows=int(rows or 0),
        failed=int(failed),
        in_flight=int(leases),
        queued=int(queued),
        state=(state or b"").decode(),
        requests=stats.requests,
        billed_prompt_tokens=stats.billed_prompt_tokens,
        billed_completion_tokens=stats.billed_completion_tokens,
        billed_reasoning_tokens=stats.billed_reasoning_tokens,
        cost_usd=stats.cost_usd,
        duplicates=stats.duplicates,
        skipped_by_workers=stats.skipped,
        errors=stats.errors,
        failures=stats.failures,
    )


def current_run(client: redis.Redis) -> dict[str, Any] | None:
    raw = client.get(CURRENT_RUN)
    return json.loads(raw) if raw else None


def read_timeline(client: redis.Redis, dataset: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in client.lrange(DatasetKeys(dataset).timeline, 0, -1)]
