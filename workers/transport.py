"""Two kombu Redis-transport tweaks for a gevent worker with 1,000 greenlets.

- **One client per channel instead of one per ack.** kombu's Redis channel builds a new
  ``redis.Redis`` object (which copies redis-py's table of ~250 response callbacks) for every
  ``QoS.append`` and every ack: 2.4% of a busy worker's main thread. The object only borrows
  connections from the channel's pool per command, so one per pool is safe to share between
  greenlets; the asynchronous client (the BRPOP loop's own connection) is left alone.
- **A new queue is consumed at once.** kombu adds a queue to its BRPOP only when the running BRPOP
  times out (up to 1 s): on every dataset start, every worker idled that long. The BRPOP
  connection's server-side id is read once per socket (``CLIENT ID``), so ``wake_consumer`` can end
  the wait with ``CLIENT UNBLOCK`` (the BRPOP returns empty, as on its timeout, and kombu starts
  over with the new queue list). Without the id (no CLIENT command allowed) it waits, as before.

Nothing else changes: the same commands on the same pool, the same messages.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

log = logging.getLogger(__name__)

_ORIGINAL_CREATE_CLIENT = kombu_redis.Channel._create_client
_ORIGINAL_BRPOP_START = kombu_redis.Channel._brpop_start


def _create_client(self: Any, asynchronous: bool = False) -> Any:
    if asynchronous:
        return _ORIGINAL_CREATE_CLIENT(self, asynchronous)
    pool = self.pool
    cached = self.__dict__.get("_specfleet_client")
    if cached is None or cached.connection_pool is not pool:  # a reconnect made a new pool
        cached = self.__dict__["_specfleet_client"] = _ORIGINAL_CREATE_CLIENT(self, False)
    return cached


def _brpop_start(self: Any, timeout: Any = None) -> Any:
    conn = getattr(self.client, "connection", None)
    if conn is not None:
        try:
            if conn._sock is None:
                conn.connect()
            if self.__dict__.get("_specfleet_brpop_sock") is not conn._sock:
                conn.send_command("CLIENT", "ID")
                self.__dict__["_specfleet_brpop_id"] = int(conn.read_response())
                self.__dict__["_specfleet_brpop_sock"] = conn._sock
        except (redis.RedisError, OSError, ValueError, TypeError):
            self.__dict__.pop("_specfleet_brpop_id", None)  # kombu reconnects; we wait as before
    return _ORIGINAL_BRPOP_START(self, timeout)


def wake_consumer(channel: Any, client: redis.Redis) -> bool:
    """End ``channel``'s running BRPOP now, so it starts over with the queues just added."""
    client_id = getattr(channel, "__dict__", {}).get("_specfleet_brpop_id")
    if client_id is None or getattr(channel, "_in_poll", None) is None:
        return False
    with contextlib.suppress(redis.RedisError):
        return bool(client.execute_command("CLIENT", "UNBLOCK", client_id))
    return False


def install() -> None:
    # setattr: mypy forbids assigning to a method.
    setattr(kombu_redis.Channel, "_create_client", _create_client)  # noqa: B010
    setattr(kombu_redis.Channel, "_brpop_start", _brpop_start)  # noqa: B010
