"""In-flight over time, for a benchmark to plot: one row per ``series_interval_s`` bucket.

Rows are written from request events (arrive, admitted, answered), not by a timer: a bucket holds
the largest in-flight counts seen in it and the arrivals and 429s in it; a bucket without events
repeats the counts the previous one ended with. ``GET /_sim/stats?series=1[&since_s=T]`` returns
``{"interval_s", "columns": [...], "rows": [[t_s, …], …]}``, ``t_s`` the bucket's start in seconds
of the ledger's uptime (the same clock as ``uptime_s``). The newest ``MAX_ROWS`` are kept.
"""

from __future__ import annotations

from collections import deque
from typing import Any

MAX_ROWS = 20_000
COLUMNS = ("t_s", "in_flight", "admitted_in_flight", "requests", "status_429", "capacity_429")


class InFlightSeries:
    def __init__(self, started_mono: float, interval_s: float) -> None:
        self.started = started_mono
        self.interval_s = interval_s
        self._rows: deque[list[float]] = deque(maxlen=MAX_ROWS)
        self._bucket = -1
        self._in_flight = 0
        self._admitted = 0

    def _row(self, now: float, interval_s: float) -> list[float]:
        if interval_s != self.interval_s:  # changed through /_sim/config: a new series
            self.interval_s = interval_s
            self._rows.clear()
            self._bucket = -1
        bucket = int((now - self.started) / self.interval_s)
        if bucket != self._bucket:
            # Buckets with no events in between repeat the last counts (at most MAX_ROWS of them).
            first = max(self._bucket + 1, bucket - MAX_ROWS + 1)
            for b in range(first, bucket + 1):
                self._rows.append([round(b * self.interval_s, 6), self._in_flight,
                                   self._admitted, 0, 0, 0])
            self._bucket = bucket
        return self._rows[-1]

    def record(self, now: float, interval_s: float, *, in_flight: int, admitted: int,
               arrived: bool = False, status: str | None = None,
               capacity_429: bool = False) -> None:
        row = self._row(now, interval_s)  # before the update: gap rows carry the old counts
        self._in_flight, self._admitted = in_flight, admitted
        row[1] = max(row[1], in_flight)
        row[2] = max(row[2], admitted)
        row[3] += arrived
        row[4] += status == "429"
        row[5] += capacity_429

    def to_json(self, since_s: float = 0.0) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "columns": list(COLUMNS),
                "rows": [list(r) for r in self._rows if r[0] >= since_s]}
