"""Which Redis a worker serves: it never joins another run on a different Redis without saying so.

A Redis restarted on its own data (AOF) is the same store: the worker carries on. But a different
server at the same address (another host after a failover without replication, a fresh container,
a test's next Redis on the same port) holds other runs, and before this a worker reconnected to it
and worked the next run's prompts as if nothing had happened, its in-flight answers of the old run
settled into the new store. So every store gets an identity (``keys.STORE_ID``, a random id the
first worker to find none writes, ``SET NX``; it persists and restarts with the data), and each
poll of the active queues reads it in the same round trip (``check``). The same id: carry on.
Another id after this worker had followed a run, while that Redis serves other runs: one line says so, every
outcome of the old run still in flight goes to the spool (where only a worker of its own Redis
replays it), no task of the new Redis is started, and the worker stops
(warm, within workers/fleet/stop.py's bound). A supervisor (compose's ``restart: unless-stopped``,
Kubernetes) starts it again, fresh, for the new Redis: explicit, rather than a silent re-join with
the old run's state. A worker that had followed no run yet just takes the new store as its own.

A store that lost its data (a Redis without persistence restarted, ``FLUSHDB``) also gets a new id,
but the producer resumes the same run on it from the shards: the worker waits (following nothing)
until the new store's active queues name a run, then carries on if that run is the one it served
(one warning line), and leaves as above if it is another.
"""

from __future__ import annotations

import logging
import os
import signal
import uuid

import redis

from common import keys
from common.redis_client import REFUSED_WRITES, describe
from workers.fleet import spool

log = logging.getLogger(__name__)

_store: str | None = None
#: The run-config id of the last run this worker followed on ``_store`` (None: none yet).
_served: str | None = None
_left: str | None = None


def left() -> bool:
    """Whether this worker found a different Redis and is leaving (no task may start)."""
    return _left is not None


def serving(config_id: str) -> None:
    """The worker follows a queue of this run, on the store it checked last."""
    global _served
    _served = config_id


def check(client: redis.Redis, url: str, raw: bytes | None, active: dict[bytes, bytes]) -> bool:
    """Whether this is still the Redis the worker served. False: it is not, and the worker is on
    its way out (said once). ``raw``, ``active``: ``keys.STORE_ID`` and ``keys.ACTIVE_QUEUES`` as the
    poll read them (one round trip, workers/fleet/queues.py)."""
    global _store, _left
    if _left is not None:
        return False
    if raw is None:
        try:
            client.set(keys.STORE_ID, uuid.uuid4().hex, nx=True)
        except REFUSED_WRITES:  # a full or read-only store cannot be told apart now: the next poll asks
            return True
        raw = client.get(keys.STORE_ID)
    store = raw.decode() if raw is not None else None
    if store is None or store == _store or _served is None or _store is None:
        _store = store if store is not None else _store
        return True
    runs = {v.decode() for v in active.values()}
    if not runs:
        return False  # no run there yet: the producer may be resuming ours on it
    if _served in runs:
        log.warning("Redis at %s has a new store id (%s, was %s): it lost its data or was replaced, and it serves "
                    "run %s, the one this worker served: carrying on", describe(url), store[:12], _store[:12], _served)
        _store = store
        return True
    _left = (f"Redis at {describe(url)} is a different Redis (store {store[:12]}, was {_store[:12]}), not the one "
             f"this worker served run {_served} on")
    spool.divert("the Redis at the URL changed")
    log.critical("%s: leaving; outcomes of that run still in flight are spooled for its own Redis, and a worker "
                 "started again serves this one", _left)
    os.kill(os.getpid(), signal.SIGTERM)
    return False
