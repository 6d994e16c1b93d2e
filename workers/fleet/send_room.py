"""How many prompts a worker takes from its queue: what it can send now, plus what it will send
within the next second, not what its pool could hold.

The pool has a quarter more greenlets than the requests a worker may have in flight
(``common/worker_cmd.pool_size``), so that tasks waiting on their budget fences hold no request slot,
and Celery prefetches up to the pool's size. Once a dataset's queue ran dry, that let one worker hold
prompts waiting for its own full slots while another worker's slots stood empty: at 15 s latency
(2 workers × 1,000, 6,000 prompts) the fleet's requests in flight sagged to ~1,700 over the run's last
10 s while the asyncio script it replaces kept ~1,990; and a worker that started a run first took a
quarter more than its share.

So a worker takes another message only while the messages it holds, less those whose task is done
with the upstream for now (rebuilding, settling, waiting for its ack, parked behind another
delivery), are fewer than its requests in flight (``SPECFLEET_CONCURRENCY``) plus a lookahead: as
many requests as ended here over the last ``LOOKAHEAD_S``. A prompt taken now needs about that long
(its prepare and its reserve's AOF fence) before it can use a slot that frees now, so the slots a
busy worker frees are refilled at once, and a worker whose requests are not ending holds no spare
prompts another worker could send. Celery's own prefetch (the pool's size) still caps it.

This module only counts; ``workers/runtime/kombu_redis.py`` asks it before kombu takes a message and lets it
wake the consumer when room opens (else kombu notices only when its poll next returns: a take
lagged the answer that made room by ~0.5 s, against ~0.05 s woken; tests/test_send_room.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import gevent

#: How far ahead a worker takes prompts, in seconds of its recent request endings.
LOOKAHEAD_S = 1.0


class SendRoom:
    """One worker process's count. Tasks say when they start and stop needing a request slot;
    the transport says which messages it delivered and acked, and asks for ``room``."""

    def __init__(self, concurrency: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.concurrency = concurrency
        self._clock = clock
        #: The task each running greenlet works for, and each delivered task's message tag.
        self._task_of: dict[Any, str] = {}
        self._tag_of: dict[str, Any] = {}
        #: Tags of held messages whose task is done with the upstream for now.
        self._done_with_upstream: set[Any] = set()
        #: When requests ended here, as far back as ``LOOKAHEAD_S``.
        self._ended: deque[float] = deque()
        #: The transport's wake-up for a consumer that found no room (set by the transport).
        self.on_open: Callable[[], None] | None = None
        #: The consumer asked and found no room: the next opening wakes it.
        self.consumer_waiting = False
        #: Upstream attempts open now, and greenlets whose attempt ended and whose outcome is not
        #: the spool's yet (workers/fleet/stop.py: a stop with Redis away ends once both are empty).
        self.requests_open = 0
        self._holding: set[Any] = set()

    # --- the transport's side ------------------------------------------------------------------

    def delivered(self, task_id: str | None, tag: Any) -> None:
        if task_id is not None:
            self._tag_of[task_id] = tag

    def acked(self, task_id: str | None, tag: Any) -> None:
        self._done_with_upstream.discard(tag)
        if task_id is not None and self._tag_of.get(task_id) == tag:
            del self._tag_of[task_id]
        self._opened()  # no room of ours (its task gave its place already), but Celery's prefetch has

    def room(self, delivered: Collection[Any], held: int) -> int:
        """How many more messages the consumer may take: ``delivered`` the tags of the messages it
        took and has not acked, ``held`` how many of them are not being acked right now."""
        # Counted against what kombu holds, so a tag a closed channel forgot counts for nothing
        # (and is dropped once such tags outnumber the held ones).
        done = sum(1 for tag in self._done_with_upstream if tag in delivered)
        if len(self._done_with_upstream) > 2 * done + 100:
            self._done_with_upstream.intersection_update(delivered)
        return self.concurrency + self.lookahead() + done - held

    def lookahead(self) -> int:
        horizon = self._clock() - LOOKAHEAD_S
        while self._ended and self._ended[0] < horizon:
            self._ended.popleft()
        return len(self._ended)

    # --- the tasks' side -----------------------------------------------------------------------

    @contextmanager
    def task(self, task_id: str) -> Iterator[None]:
        """Around a task's whole run: when it returns, only its ack is left."""
        me = gevent.getcurrent()
        self._task_of[me] = task_id
        try:
            yield
        finally:
            self._set_done(True)
            del self._task_of[me]
            self._holding.discard(me)

    @contextmanager
    def requesting(self) -> Iterator[None]:
        """Around one upstream attempt, its wait for a slot included."""
        self._set_done(False)
        me = gevent.getcurrent()
        self._holding.discard(me)
        self.requests_open += 1
        try:
            yield
        finally:
            self.requests_open -= 1
            if me in self._task_of:  # a worker's task (not a test's or a tool's call)
                self._holding.add(me)
            if self._set_done(True):
                self._ended.append(self._clock())

    def handed(self) -> None:
        """The current task handed its outcome to workers/fleet/spool.py (settle or fail)."""
        self._holding.discard(gevent.getcurrent())

    def in_flight(self) -> int:
        """Upstream attempts open, plus answers back that are not yet being settled or failed."""
        return self.requests_open + len(self._holding)

    @contextmanager
    def parked(self) -> Iterator[None]:
        """Around a wait that needs no slot (another delivery of the prompt holds its lease)."""
        self._set_done(True)
        try:
            yield
        finally:
            self._set_done(False)

    def _set_done(self, done: bool) -> bool:
        """Mark the current task; False when it is no task of this worker's consumer (a test, a
        replay), which counts for nothing."""
        task_id = self._task_of.get(gevent.getcurrent())
        tag = None if task_id is None else self._tag_of.get(task_id)
        if tag is None:
            return False
        if done:
            self._done_with_upstream.add(tag)
            self._opened()
        else:
            self._done_with_upstream.discard(tag)
        return True

    def _opened(self) -> None:
        if self.consumer_waiting and self.on_open is not None:
            self.consumer_waiting = False
            self.on_open()


#: This process's room: a worker's counts (``start``, from workers/bootstrap.py's ``boot``); anywhere else
#: (tests calling ``generate`` in process, tools) one no message is delivered to, so it counts nothing.
_process_room = SendRoom(0)


def start(concurrency: int) -> SendRoom:
    global _process_room
    _process_room = SendRoom(concurrency)
    return _process_room


def process_room() -> SendRoom:
    return _process_room
