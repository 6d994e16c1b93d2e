"""Redis refusing writes is a state of the worker, not a crash.

Redis that answers but takes no writes (``common.redis_client.REFUSED_WRITES``: maxmemory reached
with noeviction, or a read-only replica) used to end workers: kombu's unacked record, written in
its read, raised there ("Unrecoverable error"), and a paid answer whose settle was refused was
thrown away. Now whatever part of the worker meets the refusal calls ``refused(exc)``; the first
says it in one line (what, and what to do) and starts a probe that tries one small write
(``keys.WRITE_PROBE``, expiring in seconds) every ``PROBE_S``. Until a probe passes:

- the consumer takes no new message (workers/runtime/kombu_redis.py's ``can_consume``); a message it had
  taken whose unacked record was refused is kept in memory and recorded once writes are back;
- a task that meets the refusal before its request (the budget's reserve or renew, the throttle's
  slot) waits here with its message unacked (``wait``), then starts over (workers/pipeline/task.py): no
  request is sent that Redis could not record;
- a paid answer whose settle (or fail) is refused goes to the spool (workers/fleet/spool.py), replayed
  once writes are back, as after an outage;
- an ack that is refused is sent again once writes are back (a worker that dies first leaves the
  message unacked: its redelivery finds the prompt done);
- kombu's restore of unacked messages and the spool replay skip their turns;
- a consumer (re)starting waits before it binds its queues (``ensure``, workers/fleet/consumer.py): a
  worker started while Redis is full no longer exits 1 ("Unrecoverable error … SADD").

When a probe passes, one line, and everything resumes (the consumer is woken at once).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import gevent
import gevent.event
import redis

from common import keys
from common.redis_client import REFUSED_WRITES, deadline, refused_writes
from workers import WORKER_ID

log = logging.getLogger(__name__)

#: Seconds between two test writes while Redis refuses writes.
PROBE_S = 1.0

_since: float | None = None
_writable = gevent.event.Event()
_writable.set()
_on_resume: list[Callable[[], None]] = []
_client: Callable[[], redis.Redis] | None = None


def install(client: Callable[[], redis.Redis]) -> None:
    """The client the probe writes with (called lazily: the worker's context builds it)."""
    global _client
    _client = client


def refusing() -> bool:
    return _since is not None


def refused(exc: BaseException) -> None:
    """Redis refused a write: enter the state (said once), or stay in it."""
    global _since
    if _since is not None:
        return
    _since = time.monotonic()
    _writable.clear()
    log.warning("Redis refuses writes: %s. This worker sends no new request, spools the answers it has paid "
                "for and resumes by itself once Redis takes writes again", refused_writes(exc))
    gevent.spawn(_probe)


def ensure() -> None:
    """Return once Redis takes a write: one probe now, and if it is refused, the state until a
    probe passes. Unreachable is not this module's state: the caller's own connection retry waits."""
    assert _client is not None, "workers.fleet.writes.install() was not called"
    if not refusing():
        try:
            _write_probe()
            return
        except REFUSED_WRITES as exc:
            refused(exc)
        except redis.RedisError:
            return
    wait()


def wait(timeout_s: float | None = None) -> bool:
    """Until Redis takes writes again (True), or ``timeout_s`` passed (False)."""
    return bool(_writable.wait(timeout_s))


def on_resume(callback: Callable[[], None]) -> None:
    if callback not in _on_resume:
        _on_resume.append(callback)


def _write_probe() -> None:
    assert _client is not None, "workers.fleet.writes.install() was not called"
    with deadline(PROBE_S):
        _client().set(keys.WRITE_PROBE, WORKER_ID, px=10_000)


def _probe() -> None:
    global _since
    while True:
        gevent.sleep(PROBE_S)
        try:
            _write_probe()
        except redis.RedisError:  # refused still, or away: the next probe asks again
            continue
        break
    assert _since is not None
    log.warning("Redis takes writes again after %.1f s: resuming", time.monotonic() - _since)
    _since = None
    _writable.set()
    for callback in list(_on_resume):
        with contextlib.suppress(Exception):  # one callback's failure must not keep the others waiting
            callback()
