"""Celery's consumer, except that it binds nothing while Redis refuses writes.

kombu binds a worker's queues (``SADD _kombu.binding.<queue>``) when the consumer starts, and
again at each restart after an outage. Redis refusing writes then (maxmemory reached, a read-only
replica) raised out of the consumer's start, which Celery calls an "Unrecoverable error": the
worker exited 1. Now each (re)start first makes sure Redis takes a write (``writes.ensure``):
refused, the worker says so in one line (workers/fleet/writes.py) and waits for the probe to pass, then
binds and consumes.
"""

from __future__ import annotations

from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

from workers.fleet import writes


class Consumer(CeleryConsumer):
    def connect(self) -> Any:
        conn = super().connect()
        writes.ensure()
        return conn
