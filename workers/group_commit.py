"""Group commit: the budget calls of many greenlets in one pipeline, behind one AOF fence.

Each budget.lua call must not answer before its writes are in the AOF (``WAITAOF``; why:
``common/budget.py`` ``Budget._call``). A WAITAOF covers every write made before it on its
connection, so the calls that pile up while a fence is pending can share the next one: their
scripts and a single WAITAOF go out as one pipeline, and each caller wakes with its own reply once
that fence has answered. Each caller keeps its promise (no reply before its writes are durable);
a worker pays one round trip and one fence wait per batch instead of per call (with
``appendfsync everysec`` a fence waits ~0.5 s on average, so batches of tens form at a few
hundred calls a second).

At most ``BATCHES_IN_FLIGHT`` pipelines are out at once: an idle worker's call leaves at once, a
busy worker's calls wait for the next free slot. Failures are the same as unbatched:

- a broken connection: redis-py's retry (``common/redis_client.WindowRetry``) sends the whole
  pipeline again, which is safe because every budget operation is safe to repeat;
- a script the server forgot (a restart): it is loaded again and the calls that met NoScript go
  into the next batch (their ``before`` commands are not sent twice);
- a fence that failed, or Redis gone for the retry window: every caller of the batch gets the error.

A caller inside ``redis_client.deadline(s)`` (a settle that spools past its lease) still gives up
then, if Redis is away at that moment; its call may still land later, which a spooled settle or
fail tolerates (its replay is then a ``duplicate``).

Workers only (gevent); ``Budget`` uses it for the clients ``common.budget.group_commit`` registered.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import gevent
import gevent.event
import gevent.lock
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from common.redis_client import CLOCK, WAITAOF_TIMEOUT_MS, fence_failed

#: Pipelines out at once.
BATCHES_IN_FLIGHT = 2
#: Calls per pipeline at most.
BATCH_MAX_CALLS = 256
#: A script the server keeps forgetting fails its call after this many tries (as unbatched).
SCRIPT_TRIES = 3
#: While past its deadline, a caller looks this often whether Redis is away.
DEADLINE_POLL_S = 0.25


class _Call:
    __slots__ = ("args", "before", "keys", "result", "script", "tries")

    def __init__(self, script: Any, keys: Sequence[str], args: Sequence[Any],
                 before: Callable[[Any], None] | None) -> None:
        self.script, self.keys, self.args, self.before = script, keys, args, before
        self.result: gevent.event.AsyncResult = gevent.event.AsyncResult()
        self.tries = 0


class GroupCommit:
    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pending: deque[_Call] = deque()
        self._wake = gevent.event.Event()
        self._slots = gevent.lock.BoundedSemaphore(BATCHES_IN_FLIGHT)
        self._loop: gevent.Greenlet | None = None
        #: Pipelines sent and calls they carried (tests, and a profile's curiosity).
        self.batches = 0
        self.calls = 0

    def call(self, script: Any, keys: Sequence[str], args: Sequence[Any],
             before: Callable[[Any], None] | None = None) -> Any:
        """``script(keys, args)``'s reply once its writes are durable. ``before(pipe)`` queues
        commands that travel ahead of the script, once."""
        job = _Call(script, keys, args, before)
        self._pending.append(job)
        self._wake.set()
        if self._loop is None or self._loop.dead:
            self._loop = gevent.spawn(self._run)
        return self._wait(job)

    @staticmethod
    def _wait(job: _Call) -> Any:
        local = CLOCK.local_deadline()
        if local is None:
            return job.result.get()
        while True:
            timeout = max(local - time.monotonic(), DEADLINE_POLL_S)
            try:
                return job.result.get(timeout=timeout)
            except gevent.Timeout:
                if CLOCK.down_since is not None:  # as an unbatched call under a deadline gives up
                    raise RedisConnectionError("Redis unreachable past the caller's deadline") from None

    def _run(self) -> None:
        while True:
            while not self._pending:
                self._wake.clear()
                self._wake.wait()
            self._slots.acquire()
            batch = [self._pending.popleft() for _ in range(min(len(self._pending), BATCH_MAX_CALLS))]
            gevent.spawn(self._send, batch)

    def _send(self, batch: list[_Call]) -> None:
        try:
            self._commit(batch)
        except BaseException as exc:
            for job in batch:
                if not job.result.ready():
                    job.result.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._slots.release()

    def _commit(self, batch: list[_Call]) -> None:
        pipe = self._client.pipeline(transaction=False)
        at = []
        for job in batch:
            if job.before is not None:
                job.before(pipe)
                job.before = None
            pipe.evalsha(job.script.sha, len(job.keys), *job.keys, *job.args)
            at.append(len(pipe) - 1)
            job.tries += 1
        pipe.execute_command("WAITAOF", 1, 0, WAITAOF_TIMEOUT_MS)
        replies = pipe.execute(raise_on_error=False)
        self.batches += 1
        self.calls += len(batch)
        fence = replies[-1]
        again = []
        for job, i in zip(batch, at, strict=True):
            reply = replies[i]
            if isinstance(reply, NoScriptError) and job.tries < SCRIPT_TRIES:
                again.append(job)
            elif isinstance(reply, NoScriptError):
                job.result.set_exception(ResponseError("budget.lua: the server keeps forgetting the script"))
            elif isinstance(reply, Exception):
                job.result.set_exception(reply)
            elif fence_failed(fence):
                job.result.set_exception(fence)
            else:
                job.result.set(reply)
        if again:  # a restarted server: load the script again, and those calls go next
            for script in {id(j.script): j.script for j in again}.values():
                script.sha = self._client.script_load(script.script)
            self._pending.extendleft(reversed(again))
            self._wake.set()
