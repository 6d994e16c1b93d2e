"""Celery's consumer, except that it binds nothing while Redis refuses writes, nor on a server
older than specfleet supports.

kombu binds a worker's queues (``SADD _kombu.binding.<queue>``) when the consumer starts, and
again at each restart after an outage. Redis refusing writes then (maxmemory reached, a read-only
replica) raised out of the consumer's start, which Celery calls an "Unrecoverable error": the
worker exited 1. Now each (re)start first makes sure Redis takes a write (``writes.ensure``):
refused, the worker says so in one line (workers/fleet/writes.py) and waits for the probe to pass, then
binds and consumes.

Each (re)start also reads the server's version (``common/redis_server.py``): below the minimum the
worker leaves with one line and ``EXIT_REDIS_TOO_OLD`` before it takes a message, instead of
failing on the first command the server lacks (a restart or failover may bring another server).
"""

from __future__ import annotations

import sys
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

from common.errors import RedisTooOld
from common.redis_server import require_supported
from workers.fleet import writes
from workers.fleet.context import context

#: REDIS_URL names a server too old: the exit code of its class, as the CLI's (common/errors.py's table).
EXIT_REDIS_TOO_OLD = RedisTooOld.exit_code


class Consumer(CeleryConsumer):
    def connect(self) -> Any:
        conn = super().connect()
        try:
            require_supported(context().redis)
        except RedisTooOld as exc:
            sys.stderr.write(f"specfleet worker: refusing to start: {exc}\n")
            sys.stderr.flush()
            raise SystemExit(EXIT_REDIS_TOO_OLD) from None  # Celery's worker stops with this code
        writes.ensure()
        return conn
