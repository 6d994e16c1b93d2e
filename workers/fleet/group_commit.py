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

A caller inside ``redis_client.deadline(s)`` (a settle that spools past its lease) gives up as
unbatched: a batch retries only until the earliest deadline among its calls; then the calls past
their deadline get the connection error (and are never sent again: the caller spools them) while
the others go into the next batch. A call still waiting for a batch when its deadline passes with
Redis away is withdrawn and raises at once.

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

from common.errors import RedisOutage
from common.redis_client import CLOCK, UNREACHABLE, fence_command, fence_failed

#: Pipelines out at once. With ``everysec`` a fence waits ~0.5 s, and a ramp's budget reserves queue
#: behind the pipelines already out. Measured (``bench/versus_seed.py --prompts 2000 --latencies-ms
#: 15000 --fleet-only``, 2 runs each): with 2, the fleet never had 1,990 requests in flight before
#: the first answers came back; with 8 it did, 6.3 and 6.7 s after start. At 300 ms, no change.
BATCHES_IN_FLIGHT = 8
#: Calls per pipeline at most.
BATCH_MAX_CALLS = 256
#: A script the server keeps forgetting fails its call after this many tries (as unbatched).
SCRIPT_TRIES = 3
#: While past its deadline, a caller looks this often whether Redis is away.
DEADLINE_POLL_S = 0.25


class _Call:
    __slots__ = ("args", "before", "deadline", "keys", "result", "script", "sent", "tries", "withdrawn")

    def __init__(self, script: Any, keys: Sequence[str], args: Sequence[Any],
                 before: Callable[[Any], None] | None) -> None:
        self.script, self.keys, self.args, self.before = script, keys, args, before
        self.result: gevent.event.AsyncResult = gevent.event.AsyncResult()
        self.tries = 0
        #: The caller's ``redis_client.deadline`` (monotonic), if any.
        self.deadline = CLOCK.local_deadline()
        #: In a pipeline now (its caller waits for that pipeline's outcome).
        self.sent = False
        #: Its caller gave up before it was sent: never send it.
        self.withdrawn = False


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
        if job.deadline is None:
            return job.result.get()
        while True:
            try:
                return job.result.get(timeout=max(job.deadline - time.monotonic(), DEADLINE_POLL_S))
            except gevent.Timeout:
                # Past its deadline with Redis away: an unsent call is withdrawn, as an unbatched
                # call would have given up; a sent one ends with its batch, by that deadline.
                if not job.sent and CLOCK.down_since is not None:
                    job.withdrawn = True
                    raise RedisConnectionError("Redis unreachable past the caller's deadline") from None

    def _run(self) -> None:
        while True:
            while not self._pending:
                self._wake.clear()
                self._wake.wait()
            self._slots.acquire()
            batch = [self._pending.popleft() for _ in range(min(len(self._pending), BATCH_MAX_CALLS))]
            batch = [job for job in batch if not job.withdrawn]
            for job in batch:
                job.sent = True
            if batch:
                gevent.spawn(self._send, batch)
            else:
                self._slots.release()

    def _send(self, batch: list[_Call]) -> None:
        deadlines = [job.deadline for job in batch if job.deadline is not None]
        try:
            if deadlines:  # the batch gives up when its most pressed caller would have
                with CLOCK.deadline(min(deadlines) - time.monotonic()):
                    self._commit(batch)
            else:
                self._commit(batch)
        except BaseException as exc:
            self._failed(batch, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._slots.release()

    def _failed(self, batch: list[_Call], exc: BaseException) -> None:
        """Calls past their deadline (or any, when Redis stayed away for the whole window) get the
        error; the others, cut short by another caller's deadline, go into the next batch."""
        now = time.monotonic()
        again = []
        for job in batch:
            if job.result.ready():
                continue
            cut_short = isinstance(exc, UNREACHABLE) and not isinstance(exc, RedisOutage)
            if cut_short and (job.deadline is None or now < job.deadline):
                job.sent = False
                again.append(job)
            else:
                job.result.set_exception(exc)
        if again:
            self._pending.extendleft(reversed(again))
            self._wake.set()

    def _commit(self, batch: list[_Call]) -> None:
        pipe = self._client.pipeline(transaction=False)
        at = []
        for job in batch:
            if job.before is not None:  # until a pipeline carrying it got its replies
                job.before(pipe)
            pipe.evalsha(job.script.sha, len(job.keys), *job.keys, *job.args)
            at.append(len(pipe) - 1)
        pipe.execute_command(*fence_command(pipe))
        replies = pipe.execute(raise_on_error=False)
        for job in batch:
            job.before = None
            job.tries += 1
        self.batches += 1
        self.calls += len(batch)
        fence = replies[-1]
        again = []
        for job, i in zip(batch, at, strict=True):
            reply = replies[i]
            if isinstance(reply, NoScriptError) and job.tries < SCRIPT_TRIES:
                job.sent = False
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
