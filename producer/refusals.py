"""Redis refusing writes, as the producer meets it: a state it waits out, not a traceback.

A Redis that answers but takes no writes (maxmemory reached with the noeviction policy, or a
read-only replica: what a failover can leave ``REDIS_URL`` pointing at) refuses each write whole,
before it changes anything (``producer/lock.py`` keeps its scripts so: their first write is the
caller's). So the producer holds: it says once every few seconds what Redis refuses and what to do,
retries the same write with backoff, and goes on where it was when Redis takes writes again. Nothing
is lost or counted twice: the write that was refused is the one sent again. Past the retry window
(``SPECFLEET_REDIS_RETRY_WINDOW_S``, as for Redis being away) it stops with ``RedisRefusesWrites``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from redis.exceptions import ReadOnlyError

from common.errors import RedisRefusesWrites
from common.redis_client import REFUSED_WRITES

log = logging.getLogger(__name__)

T = TypeVar("T")

BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 2.0
NOTICE_EVERY_S = 5.0


def what_is_refused(exc: BaseException, where: str) -> str:
    """The refusal in one line, naming the server and what to do about it."""
    if isinstance(exc, ReadOnlyError):
        return f"Redis at {where} is a read-only replica (READONLY): point REDIS_URL at the primary"
    return (f"Redis at {where} refuses writes: OOM command not allowed (used memory over maxmemory, policy "
            "noeviction): raise maxmemory or free memory")


class WriteHold:
    """Runs a write until Redis takes it, for every thread of the producer (main and collector)."""

    def __init__(self, window_s: float, where: str, *, notice: Callable[[str], None] | None = None,
                 abort: Callable[[], bool] | None = None) -> None:
        """``notice``: shows a line (progress or log); ``abort``: true once the run is stopping,
        then a refusal raises at once instead of waiting."""
        self.window_s = window_s
        self.where = where
        self._notice = notice or (lambda text: log.warning("%s", text))
        self._abort = abort or (lambda: False)
        self._lock = threading.Lock()
        self.since: float | None = None
        self._shown_s = -NOTICE_EVERY_S

    def __call__(self, write: Callable[[], T]) -> T:
        failures = 0
        while True:
            try:
                result = write()
            except REFUSED_WRITES as exc:
                failures += 1
                self._refused(exc)
                time.sleep(min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** min(failures, 8)))
                continue
            if failures:  # a write that was never refused (a trim Redis lets through when full) says nothing
                self._accepted()
            return result

    def _refused(self, exc: BaseException) -> None:
        what = what_is_refused(exc, self.where)
        now = time.monotonic()
        with self._lock:
            if self.since is None:
                self.since = now
            elapsed = now - self.since
            show = now - self._shown_s >= NOTICE_EVERY_S
            if show:
                self._shown_s = now
        if elapsed >= self.window_s or self._abort():
            raise RedisRefusesWrites(what, elapsed) from None
        if show:
            self._notice(f"{what}; holding, nothing is lost ({elapsed:.0f} s)")

    def _accepted(self) -> None:
        if self.since is None:
            return
        with self._lock:
            since, self.since = self.since, None
            self._shown_s = -NOTICE_EVERY_S
        if since is not None:
            log.warning("Redis takes writes again after %.1f s: the run goes on", time.monotonic() - since)
