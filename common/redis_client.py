"""Redis clients that ride out Redis being away, and the durability fence (WAITAOF).

Every client specfleet builds comes from ``connect``: redis-py's own retry machinery
(``Retry`` + ``ExponentialWithJitterBackoff``) retries a command that met a connection error or a
timeout, but for a time window instead of a count. The window is measured from the moment Redis
went away (one clock per process, shared by every connection and thread), so a caller blocked in
a retry and another that starts later give up together, once, when ``window_s`` has passed.
Past it the command raises ``RedisOutage`` (a ``redis.ConnectionError``).

A thread (a greenlet in a gevent worker) can shorten the window for what it calls next with
``deadline(seconds)``: a worker settling a paid answer waits for Redis only while its lease lives,
then spools the row instead (workers/fleet/spool.py).

``REDIS_URL`` may name Sentinels instead of a server (``common/redis_url.py``): the client asks
them for the master before each new connection, and a master that went away (or answers READONLY,
demoted) is an ordinary connection error here, retried in the same window against whichever master
the Sentinels name by then. Behind Sentinel a fence also waits for a replica to have the writes
(``fence_command``): replication is asynchronous, and a failover must not forget an answer a
caller acted on.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from queue import LifoQueue
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from common import runtime
from common.errors import RedisOutage as RedisOutage  # defined in the tree; importable here as before
from common.redis_url import parse

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Errors that mean "Redis is not there right now", as opposed to a wrong command.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, socket.timeout, ConnectionResetError)
#: Errors that mean "Redis is there but takes no writes now": maxmemory reached with noeviction
#: (compose's policy: a full server must fail writes, never drop queued tasks), or a read-only
#: replica (what a failover can leave a URL pointing at). Not retried by the window: a caller
#: decides (workers/fleet/writes.py waits, workers/fleet/spool.py spools).
REFUSED_WRITES = (OutOfMemoryError, ReadOnlyError)
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0
#: How long a WAITAOF may wait for the AOF fsync (appendfsync everysec: about a second at most).
WAITAOF_TIMEOUT_MS = 5000


def refused_writes(exc: BaseException) -> str:
    """What a ``REFUSED_WRITES`` error means and what to do about it, in a few words."""
    if isinstance(exc, ReadOnlyError):
        return "it is a read-only replica (READONLY): point REDIS_URL at the primary"
    return ("it is full (OOM: used memory over maxmemory, policy noeviction): raise maxmemory "
            "(REDIS_MAXMEMORY in compose) or free memory")


class OutageClock:
    """When Redis went away (None while it answers); observers hear of every failed attempt."""

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.outages = 0  # finished outages, so a caller can notice one happened since it looked
        self._observers: list[Callable[[float], None]] = []
        self._local = threading.local()  # gevent patches it to be greenlet-local in workers

    def failed(self) -> float:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
        elapsed = now - self.down_since
        for observer in list(self._observers):
            with contextlib.suppress(Exception):  # a display problem must not break a retry
                observer(elapsed)
        return elapsed

    def answered(self) -> None:
        if self.down_since is not None:
            away_s = time.monotonic() - self.down_since
            if away_s >= 1.0:  # shorter: a reply that was already on its way when Redis went
                log.warning("Redis is reachable again after %.1f s", away_s)
            self.down_since = None
            self.outages += 1

    def observe(self, observer: Callable[[float], None]) -> None:
        self._observers.append(observer)

    def unobserve(self, observer: Callable[[float], None]) -> None:
        with contextlib.suppress(ValueError):
            self._observers.remove(observer)

    def local_deadline(self) -> float | None:
        return getattr(self._local, "deadline", None)

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Calls in this block give up ``seconds`` from now at the latest."""
        previous = self.local_deadline()
        self._local.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self._local.deadline = previous


#: One per process: every connection of every client shares it (redis-py deep-copies Retry objects,
#: so the clock cannot live on them).
CLOCK = OutageClock()
deadline = CLOCK.deadline


class DeadlineQueue(LifoQueue):
    """A bounded pool's free connections: while Redis is away, a caller inside ``deadline(s)`` waits
    for one until its deadline at most. With Redis away every connection of a worker's pool can be held by callers
    retrying for the window, and a settle past its lease waited the pool's own 30 s for a free one
    before it could spool (a stopping worker left such answers unspooled at its bound)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        local = CLOCK.local_deadline()
        # Only while Redis is away: with it up, a busy pool's wait is no sign to give up on.
        if block and local is not None and CLOCK.down_since is not None:
            left_s = max(0.0, local - time.monotonic())
            timeout = left_s if timeout is None else min(timeout, left_s)
        return super().get(block, timeout)


class WindowRetry(Retry):
    """redis-py's Retry, bounded by time since Redis went away instead of by a count."""

    def __init__(self, window_s: float) -> None:
        super().__init__(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), 10**9, UNREACHABLE)
        self.window_s = window_s

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                elapsed = CLOCK.failed()
                local = CLOCK.local_deadline()
                if elapsed >= self.window_s:
                    raise RedisOutage(self.window_s, error) from error
                if local is not None and time.monotonic() >= local:
                    raise
                time.sleep(self._backoff.compute(failures))
                continue
            CLOCK.answered()
            return result


class SentinelConnection(SentinelManagedConnection):
    """redis-py's connection behind Sentinel, except that one which lost its socket asks the
    Sentinels for the master whichever way it reconnects (a fenced override: common/runtime.py checks
    the method it replaces is the one verified). redis-py (8.1) does so in ``connect()``
    only; a command sent on a disconnected connection (``send_packed_command``: every pipeline,
    every retry of a command that met the old master's death) reconnects through
    ``connect_check_health``, which retries the address the connection had: after a failover, the
    dead master's, for the whole retry window (seen: settles spooled 7 s after the promotion)."""

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        if self._sock:
            return
        if retry_socket_connect:  # the path that would retry a stale address: ask the Sentinels
            self.connect()
            return
        super().connect_check_health(check_health=check_health, retry_socket_connect=False)


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """A bounded pool whose connections find the master through Sentinel: a caller past
    ``max_connections`` waits ``timeout`` for one, as with ``redis.BlockingConnectionPool``."""


def connect(url: str, window_s: float, *, blocking_timeout_s: float | None = None, **kwargs: Any) -> redis.Redis:
    """A client whose commands retry for ``window_s`` while Redis is unreachable. ``url`` is
    ``REDIS_URL`` (a server or Sentinels); with ``blocking_timeout_s`` (and ``max_connections``)
    a caller waits that long for a free connection instead of being refused one."""
    runtime.install()  # redis-py's fenced patches (common/runtime.py), before its first connection
    kwargs.setdefault("socket_timeout", 30)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 25)
    # Without driver info a new connection skips two CLIENT SETINFO round trips (lib name and
    # version, shown by CLIENT LIST); a worker opens a thousand connections at its ramp.
    kwargs.setdefault("driver_info", None)
    kwargs.update(retry=WindowRetry(window_s), retry_on_error=list(UNREACHABLE))
    if blocking_timeout_s is not None:
        kwargs["timeout"] = blocking_timeout_s
        kwargs["queue_class"] = DeadlineQueue
    target = parse(url)
    if not target.is_sentinel:
        if blocking_timeout_s is not None:
            return redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(url, **kwargs))
        return redis.Redis.from_url(url, **kwargs)
    # A master lookup that meets no Sentinel is a connection error like any other: the command's
    # WindowRetry tries again (each Sentinel client tries once, so a dead one costs one attempt).
    sentinels = Sentinel(list(target.sentinels), sentinel_kwargs={**target.sentinel_kwargs(), "retry": Retry(
        ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), 0)})
    assert target.master_name is not None  # parse() refuses a Sentinel URL without one
    pool_class = BlockingSentinelPool if blocking_timeout_s is not None else SentinelConnectionPool
    return sentinels.master_for(target.master_name, connection_pool_class=pool_class, db=target.db,
                                username=target.username, password=target.password,
                                connection_class=SentinelConnection, **kwargs)


class ReplicaFence:
    """How many replicas a fence behind Sentinel waits for: one while the master has one online.

    Replication is asynchronous: a write the master acknowledged may not have reached the replica
    the Sentinels promote when it dies, and a settle or an ack lost that way is a paid answer asked
    again. ``WAITAOF 1 1`` answers once a replica has the writes in its own AOF too. With no replica
    online it would wait its whole timeout for nothing, so the count is read from the master (at
    most every ``REFRESH_S``); a replica without AOF never confirms, so after one fence that waited
    in vain the replica part is left out for ``PAUSE_S``, with a warning.
    """

    REFRESH_S = 1.0
    PAUSE_S = 60.0

    def __init__(self) -> None:
        self._online = 0
        self._read_at = -float("inf")
        self._read_outages = 0
        self._asking_since: float | None = None
        self._asking_outages = 0
        self._paused_until = -float("inf")

    def wanted(self, pool: redis.ConnectionPool) -> int:
        now = time.monotonic()
        if now < self._paused_until:
            return 0
        # Read again after an outage too: the master may be another one now (a failover), whose
        # replica is gone with the old master; the count of the old one would make fences wait.
        after_outage = CLOCK.outages != self._read_outages
        if after_outage or now - self._read_at >= self.REFRESH_S:
            if after_outage:
                self._asking_since = None  # asked of this master from now on
            self._read_at, self._read_outages = now, CLOCK.outages
            with contextlib.suppress(redis.RedisError):  # the fence itself will meet it
                info = redis.Redis(connection_pool=pool).info("replication")
                self._online = sum(1 for k, v in info.items()
                                   if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")
        if self._online and self._asking_since is None:
            self._asking_since = now
            self._asking_outages = CLOCK.outages
        elif not self._online:
            self._asking_since = None
        return min(1, self._online)

    def heard(self, answer: object) -> None:
        """A fence's reply; ``[local, 0]`` long after replicas were first asked for means it waited in vain."""
        since = self._asking_since
        if not (isinstance(answer, list) and len(answer) == 2 and answer[1] == 0 and since is not None):
            return
        if CLOCK.outages != self._asking_outages:
            # A fence built before an outage and sent again after it (a retry runs the same
            # pipeline) asked the old master's replica count of the new master: no sign of a
            # replica without AOF. (Those batches wait the fence's timeout once per failover.)
            return
        if time.monotonic() - since > 2 * WAITAOF_TIMEOUT_MS / 1000:  # not a reply to a fence asked for none
            self._paused_until = time.monotonic() + self.PAUSE_S
            self._asking_since = None
            log.warning("no replica confirmed a write in its AOF within %.0f s (appendonly no on the "
                        "replicas?); fences wait for the master's AOF only for the next %.0f s",
                        WAITAOF_TIMEOUT_MS / 1000, self.PAUSE_S)


#: One per process, as the clock: every client of a process talks to the same master.
REPLICAS = ReplicaFence()


def fence_command(client: redis.Redis | redis.client.Pipeline) -> tuple[Any, ...]:
    """The WAITAOF a caller queues after its writes, to reply only once they are durable: in the
    master's AOF, and behind Sentinel in a replica's too (``ReplicaFence``)."""
    pool = client.connection_pool
    replicas = REPLICAS.wanted(pool) if isinstance(pool, SentinelConnectionPool) else 0
    return ("WAITAOF", 1, replicas, WAITAOF_TIMEOUT_MS)


class FencedTransaction(redis.client.Pipeline):
    """A MULTI/EXEC whose fence follows its EXEC on the same connection, in the same retry.

    Not inside the MULTI: a command the server does not know (WAITAOF before Redis 7.2) is refused
    when queued and EXEC then discards the whole transaction (EXECABORT: batch mode never submitted
    on Redis 7.0 or 6.2). After EXEC the fence waits for every write of this connection so far,
    the transaction's included; on those servers it answers "unknown command", which ``fence_failed``
    lets pass, as for any pipeline. Two round trips, once per batch record: not on a hot path.
    Relies on redis-py's private ``_execute_transaction`` (``common/runtime.py`` checks its source)."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(client.connection_pool, client.response_callbacks, transaction=True, shard_hint=None)
        self.fence: object = None
        self._fence_command: tuple[Any, ...] = ()

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> list[Any]:
        replies = super()._execute_transaction(connection, commands, raise_on_error)
        connection.send_command(*self._fence_command)
        try:
            self.fence = connection.read_response()
        except redis.ResponseError as error:
            self.fence = error
        return replies

    def execute_fenced(self) -> list[Any]:
        """The transaction's replies once durable; raises its first error, or the fence's."""
        # Built before a connection is taken: behind Sentinel it may read the replica count on
        # another connection of the same (bounded) pool.
        self._fence_command = fence_command(self)
        replies = self.execute(raise_on_error=False)
        if fence_failed(self.fence):
            raise self.fence  # type: ignore[misc]  # fence_failed: an Exception
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return list(replies)


def fence_failed(answer: object) -> bool:
    """Whether a WAITAOF reply is an error worth raising. A server without AOF, or one older than
    Redis 7.2 (no WAITAOF), cannot fence: the caller goes on as without the fence."""
    if not isinstance(answer, Exception):
        REPLICAS.heard(answer)
        return False
    text = str(answer).lower()
    return "appendonly" not in text and "unknown command" not in text


def describe(url: str) -> str:
    """Where a ``REDIS_URL`` points (``host:port/db``, or the Sentinels and master), without a password."""
    return parse(url).describe()
