"""The per-dataset counters (``DatasetKeys.stats``): the only Python that writes and parses them, by
the names of the accounting record (``common/accounting.COUNTERS``, which names their fields).

Workers write through ``DatasetStats`` (``add``: any counter by name, one round trip per event); a
kept or failed answer's usage is added by budget.lua itself with its settle or fail
(``answer_counts``, from the counters' ``usage``), so a settle executed twice (a lost reply: a spool
replay, a resent pipeline) counts its request once; the producer's progress, metrics and reports
read through ``DatasetStats.read`` or ``parse`` (for a caller that already pipelined the HGETALL).
Counters only ever grow, so any read is consistent enough for a progress bar.

Fields: the record's counters (each under its ``source``), ``err:<reason>`` per failed upstream
attempt (``err:http_429`` …) and ``fail:<reason>`` per prompt that ended failed
(``fail:token_mismatch`` …); ``prompts``, ``duplicate_prompts`` and ``excluded_prompts`` the
producer sets once it has read the file (not counters).

Also the fleet-wide misconfiguration streak (``keys.MISCONFIG_STREAK``): prompts that met a
"wrong URL or model" answer since the last answer anywhere (``workers/pipeline/retry.py`` halts on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from common.accounting import BY_NAME, PER_ANSWER, PER_ANSWER_COUNTERS, Counted, parse_counts
from common.contract import Usage
from common.keys import MISCONFIG_STREAK, DatasetKeys

#: Good prompts in the dataset's file, set by the producer once it has read the file (not a
#: counter): the exporter's skipped = prompts without an outcome, as summary.json counts them.
PROMPTS = "prompts"
#: Good prompts of the file not asked: duplicates of an earlier prompt of the run, eval leaks.
DUPLICATE_PROMPTS = "duplicate_prompts"
EXCLUDED_PROMPTS = "excluded_prompts"
_ERROR = "err:"
_FAILURE = "fail:"

#: A streak older than this is forgotten: a stale run's misses must not halt today's on one miss.
MISCONFIG_STREAK_TTL_S = 600


@dataclass
class StatsSnapshot(Counted):
    """The counters (``common/accounting.COUNTERS``) and the two reason maps."""

    #: Failed upstream attempts by reason (``http_429``, ``timeout`` …).
    errors: dict[str, int] = field(default_factory=dict)
    #: Prompts that ended failed, by reason (``retries_exhausted``, ``prompt_too_long`` …).
    failures: dict[str, int] = field(default_factory=dict)


def answer_counts(usage: Usage) -> dict[str, int]:
    """One billed answer's increments, by field: what budget.lua adds with its settle, fail or
    release (``Budget.settle(usage=…)``), once per lease, and nowhere else (a count outside the
    script would be added again by a replayed settle). The counters whose ``usage`` names a key
    of ``Usage`` (a key absent: 0), and ``PER_ANSWER`` ones 1."""
    billed: dict[str, Any] = dict(usage)
    return {c.source: 1 if c.usage == PER_ANSWER else c.raw(billed.get(c.usage or "", 0)) for c in PER_ANSWER_COUNTERS}


def queue_answered(pipe: Any) -> None:
    """An answer came back: the fleet's misconfiguration streak starts over (safe to repeat)."""
    pipe.delete(MISCONFIG_STREAK)


class DatasetStats:
    def __init__(self, client: redis.Redis, dataset: str) -> None:
        self._client = client
        self.key = DatasetKeys(dataset).stats

    # --- writers (workers) --------------------------------------------------------------------

    def record_error(self, reason: str) -> None:
        self._client.hincrby(self.key, _ERROR + reason, 1)

    def record_failure(self, reason: str) -> None:
        self._client.hincrby(self.key, _FAILURE + reason, 1)

    def add(self, **by_name: int | float) -> None:
        """Add to counters of the accounting record (``common/accounting.COUNTERS``), by name;
        dollars in USD. One round trip."""
        pipe = self._client.pipeline(transaction=False)
        for name, value in by_name.items():
            counter = BY_NAME.get(name)
            if counter is None:
                raise KeyError(f"{name} is not a counter of common/accounting.py")
            pipe.hincrby(self.key, counter.source, counter.raw(value))
        pipe.execute()

    def record_duplicate(self) -> None:
        self.add(duplicates=1)

    def record_skipped(self) -> None:
        self.add(skipped_by_workers=1)

    def record_batch(self, **by_name: int | float) -> None:
        """The batch path's counters (``batch_*`` of ``common/accounting.COUNTERS``), by name; dollars in USD."""
        if stray := [name for name in by_name if not name.startswith("batch_")]:
            raise KeyError(f"{stray[0]} is not a batch counter")
        self.add(**by_name)

    def record_prompts(self, prompts: int, duplicates: int = 0, excluded: int = 0) -> None:
        """The producer, once it has read the dataset's file (every run: the same file, the same count):
        the prompts it asks, and those it leaves out (common/prompt_filter.py)."""
        self._client.hset(self.key, mapping={PROMPTS: prompts, DUPLICATE_PROMPTS: duplicates,
                                             EXCLUDED_PROMPTS: excluded})

    def record_engine_check(self, match: bool, prompt_match: bool) -> None:
        """One kept row with the engine's ids, and whether the text rebuild and the rendered prompt
        agreed with them."""
        self.add(engine_rows=1, engine_mismatch=0 if match else 1, engine_prompt_mismatch=0 if prompt_match else 1)

    def record_usage_check(self, match: bool) -> None:
        """One kept row whose billed usage was compared with the fleet's counts (common/usage_check.py)."""
        self.add(usage_checked=1, usage_mismatch=0 if match else 1)

    def record_misconfigured(self, prompt_id: str) -> int:
        """Add ``prompt_id`` to the fleet's streak; returns how many distinct prompts it holds."""
        pipe = self._client.pipeline(transaction=True)
        pipe.sadd(MISCONFIG_STREAK, prompt_id)
        pipe.expire(MISCONFIG_STREAK, MISCONFIG_STREAK_TTL_S)
        pipe.scard(MISCONFIG_STREAK)
        return int(pipe.execute()[-1])

    # --- readers (producer) -------------------------------------------------------------------

    def read(self) -> StatsSnapshot:
        return self.parse(self._client.hgetall(self.key))

    @staticmethod
    def parse(raw: dict[bytes, bytes]) -> StatsSnapshot:
        """A snapshot from the hash's HGETALL reply."""
        counts = {k.decode(): int(v) for k, v in raw.items()}
        return StatsSnapshot(
            **parse_counts(counts),
            errors={k.removeprefix(_ERROR): v for k, v in counts.items() if k.startswith(_ERROR)},
            failures={k.removeprefix(_FAILURE): v for k, v in counts.items() if k.startswith(_FAILURE)},
        )

__all__ = ["DatasetStats", "StatsSnapshot"]
