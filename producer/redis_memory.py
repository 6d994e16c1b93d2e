"""What a run asks of Redis' memory, estimated before it starts, and whether ``maxmemory`` allows it.

With the queue window (producer/window.py) a dataset's size no longer sets Redis' memory; what does:

- the window: at most ``WindowBounds.bytes``, and at most ``WindowBounds.prompts`` messages (a message
  is ~1.33x its JSONL line, base64 of msgpack, plus ~970 bytes of envelope: ``message_bytes``);
- the messages workers hold (kombu's unacked hash): one per request in flight, the run's
  ``[request] max_in_flight`` or ``ASSUMED_IN_FLIGHT`` when it sets none;
- per kept row, kept for the run's life: its id in the done set (``DONE_BYTES_PER_ROW``, measured
  with MEMORY USAGE) and its settle record (``SETTLED_BYTES_PER_ROW``, expires 7 days after the
  dataset's last outcome), for the rows the budget is expected to keep (the plan's "rows to budget");
- rows waiting in the results stream for the collector (``STREAM_ROWS``, each ~3x its prompt: the
  text and its token ids), and ``BASELINE_BYTES`` for Redis itself and its AOF rewrite buffer.

An estimate, stated as one: it warns when ``maxmemory`` is under it, and says "unknown" when the
server refuses CONFIG GET (a managed Redis often does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis

from common.config import RunConfig
from producer.window import WindowBounds

#: A SET member of an id of up to ~22 characters (``p0000123``, ``h-<20 hex>``): 37.7 B measured
#: (MEMORY USAGE of 200,000 such members, Valkey 8); a 36-character UUID id costs 53 B.
DONE_BYTES_PER_ROW = 38
#: A ``settled`` hash entry ("<lease>:<id>" -> "<answer>|<over_hold>"), measured the same way.
SETTLED_BYTES_PER_ROW = 120
ENVELOPE_BYTES = 970
ASSUMED_IN_FLIGHT = 2_000
STREAM_ROWS = 500
BASELINE_BYTES = 8 << 20


def message_bytes(line_bytes: float) -> int:
    """A task message's size in Redis for a JSONL line of ``line_bytes``."""
    return int(line_bytes * 4 / 3) + ENVELOPE_BYTES


@dataclass(frozen=True)
class RedisNeed:
    window_bytes: int
    in_flight_bytes: int
    per_row_bytes: int
    other_bytes: int

    @property
    def total(self) -> int:
        return self.window_bytes + self.in_flight_bytes + self.per_row_bytes + self.other_bytes

    def describe(self) -> str:
        return (f"~{_mib(self.total)} (window {_mib(self.window_bytes)}, messages in flight "
                f"{_mib(self.in_flight_bytes)}, done sets {_mib(self.per_row_bytes)}, stream and Redis itself "
                f"{_mib(self.other_bytes)})")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def estimate(cfg: RunConfig, window: WindowBounds, shapes: list[tuple[int, int]]) -> RedisNeed:
    """``shapes``: each dataset's (lines, bytes) of its file, in ``cfg.datasets`` order."""
    largest_message = 0
    rows_bytes = 0
    stream = 0
    for ds, (lines, size) in zip(cfg.datasets, shapes, strict=True):
        mean_line = size / lines if lines else 0.0
        largest_message = max(largest_message, message_bytes(mean_line))
        length = cfg.length_for(ds.length)
        expected = length.estimate_tokens or max(1, length.max_tokens // 4)
        rows = min(lines, math.ceil(ds.budget_tokens / expected))
        rows_bytes += rows * (DONE_BYTES_PER_ROW + SETTLED_BYTES_PER_ROW)
        stream = max(stream, STREAM_ROWS * 3 * int(mean_line))
    queued = min(window.bytes, window.prompts * largest_message)
    in_flight = (cfg.request.max_in_flight or ASSUMED_IN_FLIGHT) * largest_message
    return RedisNeed(queued, in_flight, rows_bytes, stream + BASELINE_BYTES)


def verdict(need: RedisNeed, limit: int | None, *, refused: bool = False) -> tuple[bool, str]:
    """(too small, the line that says so)."""
    if limit is None:
        why = "unknown (CONFIG GET refused)" if refused else "none set"
        return False, f"Redis memory: this run needs {need.describe()}; maxmemory {why}"
    if limit < need.total:
        return True, (f"Redis memory: this run needs {need.describe()}, over maxmemory {_mib(limit)}: raise "
                      f"maxmemory or lower SPECFLEET_QUEUE_WINDOW_BYTES / _PROMPTS")
    return False, f"Redis memory: this run needs {need.describe()}, within maxmemory {_mib(limit)}"


def check(client: redis.Redis, cfg: RunConfig, window: WindowBounds) -> tuple[bool, str]:
    """Estimate from the files' bytes (no JSON parsed) and compare with the server's maxmemory."""
    from producer.plan import byte_shape

    shapes = [(s.lines, s.bytes) for s in (byte_shape(d.path, d.max_line_bytes) for d in cfg.datasets)]
    need = estimate(cfg, window, shapes)
    try:
        raw = client.config_get("maxmemory")
    except redis.ResponseError:
        return verdict(need, None, refused=True)
    return verdict(need, int(raw.get("maxmemory", 0)) or None)
