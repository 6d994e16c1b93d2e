"""Open Batch API batches as Redis records them (``workers/pipeline/batch/records.py`` writes them): read by
workers and by the producer's progress, ``specfleet status`` and the exporter.

A record (``keys.BatchKeys.record``) is a batch's intent and what became of it: ``state`` posting
(written before the POST; the batch id not known yet) → submitted (OpenRouter's batch id recorded)
→ done; ``remote_status`` is OpenRouter's word (validating, in_progress, finalizing, completed,
failed, expired). ``keys.BATCHES_OPEN`` holds the batches not yet done.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import redis

from common import keys
from common.keys import BatchKeys

POSTING, SUBMITTED, DONE = "posting", "submitted", "done"


@dataclass
class Intent:
    id: str
    run: str
    dataset: str
    model: str
    created_s: float
    n: int
    state: str = POSTING
    batch_id: str = ""
    remote_status: str = ""
    completed: int = 0
    failed: int = 0

    def fields(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def parse(cls, raw: dict[bytes, bytes]) -> Intent:
        d = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(id=d["id"], run=d["run"], dataset=d["dataset"], model=d["model"], created_s=float(d["created_s"]),
                   n=int(d["n"]), state=d.get("state", POSTING), batch_id=d.get("batch_id", ""),
                   remote_status=d.get("remote_status", ""), completed=int(d.get("completed") or 0),
                   failed=int(d.get("failed") or 0))


def load(client: redis.Redis, intent_id: str) -> Intent | None:
    raw = client.hgetall(BatchKeys(intent_id).record)
    return Intent.parse(raw) if raw else None


def open_intents(client: redis.Redis) -> list[str]:
    return [m.decode() for m in client.zrange(keys.BATCHES_OPEN, 0, -1)]


def open_batches(client: redis.Redis) -> list[dict[str, Any]]:
    """Every open batch's record, for progress, ``specfleet status`` and the exporter: dataset,
    requests, age, state (ours: posting | submitted; OpenRouter's: remote_status)."""
    out = []
    now = time.time()
    for intent_id in open_intents(client):
        intent = load(client, intent_id)
        if intent is None:
            continue
        out.append({"intent": intent.id, "dataset": intent.dataset, "batch_id": intent.batch_id,
                    "requests": intent.n, "age_s": round(now - intent.created_s, 1), "state": intent.state,
                    "status": intent.remote_status or intent.state, "completed": intent.completed,
                    "failed": intent.failed})
    return out


def summary(batches: list[dict[str, Any]]) -> str:
    """One line for the open batches (``open_batches``): how many, their requests, the oldest's age
    and how many are in each state, e.g. ``2 open, 1,500 requests, oldest 42 s (in_progress 1,
    validating 1)``. Empty: ``none open``."""
    if not batches:
        return "none open"
    tally = ", ".join(f"{s} {n}" for s, n in states(batches).items())
    return (f"{len(batches)} open, {sum(b['requests'] for b in batches):,} requests, oldest "
            f"{max(b['age_s'] for b in batches):,.0f} s ({tally})")


def states(batches: list[dict[str, Any]]) -> dict[str, int]:
    """How many open batches are in each state (OpenRouter's word, or ``posting``), by name."""
    out: dict[str, int] = {}
    for b in batches:
        out[b["status"]] = out.get(b["status"], 0) + 1
    return dict(sorted(out.items()))


def line(b: dict[str, Any]) -> str:
    """One open batch: ``B batch_12ab: in_progress · 1,000 requests (600 done, 0 failed) · 42 s old``."""
    return (f"{b['dataset']} {b['batch_id'] or '(posting)'}: {b['status']} · {b['requests']:,} requests "
            f"({b['completed']:,} done, {b['failed']:,} failed) · {b['age_s']:,.0f} s old")
