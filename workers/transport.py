"""One kombu Redis client per channel instead of one per ack.

kombu's Redis channel builds a new ``redis.Redis`` object (which copies redis-py's table of ~250
response callbacks) for every ``QoS.append`` and every ack: 2.4% of a busy worker's main thread.
The object only borrows connections from the channel's pool per command, so one per pool is safe
to share between greenlets; the asynchronous client (the BRPOP loop's own connection) is left
alone. Nothing else changes: the same commands on the same pool.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis

_ORIGINAL = kombu_redis.Channel._create_client


def _create_client(self: Any, asynchronous: bool = False) -> Any:
    if asynchronous:
        return _ORIGINAL(self, asynchronous)
    pool = self.pool
    cached = self.__dict__.get("_specfleet_client")
    if cached is None or cached.connection_pool is not pool:  # a reconnect made a new pool
        cached = self.__dict__["_specfleet_client"] = _ORIGINAL(self, False)
    return cached


def install() -> None:
    setattr(kombu_redis.Channel, "_create_client", _create_client)  # noqa: B010 - a method, mypy forbids assigning it
