"""A worker process's door to the fleet-wide throttle (``common/throttle.py``).

When the fleet is at its limit, a thousand greenlets asking Redis for a slot every few milliseconds
would cost more CPU than the requests they wait to send. So the waiting requests of a process queue
locally, in arrival order, and one greenlet (the pump) asks for all of them at once: one Lua call
grants as many slots as the fleet's limit allows (up to ``MAX_BATCH``), whatever the queue's length.
A slot freed in this process wakes the pump at once; slots freed elsewhere are noticed within
``POLL_S``. Asking one slot per call, a process busy with 500 greenlets could not take slots as fast
as its answers freed them (the bench measured ~190 in flight under a limit of 277).

``Gate.slot`` wraps one upstream attempt: it acquires, and releases with the attempt's outcome read
from what the attempt returned or raised (``outcome_of``).

Answers of the moment give their slots back together: ``release`` queues and returns at once, and
one greenlet sends what queued meanwhile in one call (a call per answer was 6% of a busy worker).

The gate also holds the process to ``max_in_flight`` upstream requests (``SPECFLEET_CONCURRENCY``).
The pool has more greenlets than that (``common/worker_cmd.pool_size``): a task spends about a
second outside its request, waiting for its budget reserve and its settle to reach the AOF, and
with one greenlet per request slot that second would be a slot left empty every round (7% of the
throughput at 15 s latency). Here a slot is taken only for the request itself.

Under a fixed fleet-wide cap (``[request] max_in_flight``), a process whose own slots are all taken
borrows what other processes leave unused, up to ``borrow_up_to`` (its pool's greenlets): when a
dataset's queue runs dry, one worker still holds prepared prompts (about a second's worth, see
``workers/fleet/send_room.py``) while another's slots empty, and at 15 s latency that idled ~450
slot-seconds of a 78 s run (the script's single semaphore: ~40). A borrower leaves a few slots of
the cap free (``keep_free``) and borrows nothing while a process within its share has just asked in
vain or given slots back with requests waiting (``throttle.lua``'s ``want_ms``), so a process under
its share is not kept waiting by one over it; and without a fixed cap nobody borrows (the adaptive
limit alone would let every process run a quarter over what its operator sized it for).

While a run's plan is still counting, the throttle answers every ask with "hold": the pump asks
again every ``HOLD_POLL_S`` and meanwhile has each upstream open the connections of its waiting
requests (``warm``), so the first wave leaves together the moment the plan passes.
"""

from __future__ import annotations

import itertools
import logging
import random
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import gevent
import gevent.event

from common.config import ThrottleLimits
from common.errors import InFlightBudgetError, UpstreamError
from common.redis_client import deadline
from common.throttle import NO_CAPS, FleetThrottle, Release, SlotOutcome

log = logging.getLogger(__name__)

#: How often the head asks again while the fleet is at its limit and nothing here was freed.
POLL_S = 0.05
#: How often the head asks again while the producer's plan holds every request: a shorter wait
#: than POLL_S, as every process's whole first wave is queued behind it (one call per process).
HOLD_POLL_S = 0.02
#: While queued this long, the waiting request's keepalive runs (the budget lease is renewed).
KEEPALIVE_EVERY_S = 5.0
#: Most slots one call asks for: bounds the script's time in Redis (a ZADD each).
MAX_BATCH = 200
#: A process borrowing over its own share leaves this many slots of the fleet's cap free (fewer
#: under a small cap: one per 50 slots, at least one), for processes under theirs.
LEND_MARGIN = 8
#: A release waits at most this long for an unreachable Redis: the slot expires by its TTL, and the
#: paid answer has its settle (and the spool) to reach, within the lease's slack.
RELEASE_WAIT_S = 2.0
#: "Too many requests" and "overloaded": the provider's capacity speaking, whoever said it.
THROTTLED_STATUSES = frozenset({429, 503})


def outcome_of(error: BaseException | None) -> tuple[SlotOutcome, float | None]:
    """The throttle's reading of one attempt (None: it answered) and the Retry-After it carried.

    A 429/503, or a 200 whose error object has code 429/503 (openrouter.md), is the provider
    saying "too many", and the account's in-flight budget (a 402) says the same of the balance;
    a timeout, a 400 or a worker shutting down says nothing about capacity."""
    if error is None:
        return "ok", None
    if isinstance(error, InFlightBudgetError):  # the account: too much in flight for its balance
        return "budget", error.retry_after_s
    if isinstance(error, UpstreamError) and (error.status in THROTTLED_STATUSES
                                             or error.code in THROTTLED_STATUSES):
        return "throttled", error.retry_after_s
    return "other", None


class Receipt:
    """What an attempt inside a slot reports for its release: what its answer cost (USD)."""

    __slots__ = ("cost_usd",)

    def __init__(self) -> None:
        self.cost_usd = 0.0


class _Waiter:
    __slots__ = ("error", "gone", "granted", "limits", "slot", "ttl_ms", "warm", "woken")

    def __init__(self, ttl_ms: int, limits: ThrottleLimits, warm: Callable[[int], None] | None = None) -> None:
        self.slot = uuid.uuid4().hex
        self.ttl_ms, self.limits, self.warm = ttl_ms, limits, warm
        self.woken = gevent.event.Event()
        self.granted = False
        self.gone = False  # gave up (keepalive raised, killed) before a slot came
        self.error: BaseException | None = None


class Gate:
    def __init__(self, throttle: FleetThrottle, *, max_in_flight: int | None = None,
                 borrow_up_to: int | None = None, batch_releases: bool = False) -> None:
        """``max_in_flight``: this process's share; ``borrow_up_to``: how far over it the process may
        go on slots others leave unused, under a fixed fleet-wide cap. ``batch_releases``: in a
        gevent worker (a releaser greenlet needs a hub that runs while tasks wait on sockets);
        otherwise each release is its own call."""
        self._throttle = throttle
        self._batch_releases = batch_releases
        self._releases: list[Release] = []
        self._releaser: gevent.Greenlet[[], None] | None = None
        self._queue: deque[_Waiter] = deque()
        self._pump: gevent.Greenlet[[], None] | None = None
        self._freed = gevent.event.Event()
        #: This process's share of requests in flight (None: the fleet's limit alone), how far over it
        #: it may borrow, and its slots held.
        self._cap = max_in_flight
        self._borrow_cap = max(borrow_up_to or 0, max_in_flight or 0)
        self.held = 0

    @contextmanager
    def slot(self, *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS,
             keepalive: Callable[[], None] | None = None,
             warm: Callable[[int], None] | None = None, worst_usd: float | None = None) -> Iterator[Receipt]:
        """One upstream attempt inside a fleet-wide slot, released with its outcome (an exception
        of the attempt passes through). ``warm(n)``: the upstream's way to open the connections
        of ``n`` waiting requests while the run's plan holds them (``OpenRouterClient.warm``).
        ``worst_usd``: the request's worst case as the account's in-flight budget weighs it; an
        answer whose cost the attempt puts in the yielded ``Receipt`` spent that share of one
        worst case from the balance (``Release.drain``)."""
        slot = self.acquire(ttl_ms=ttl_ms, limits=limits, keepalive=keepalive, warm=warm)
        receipt = Receipt()
        try:
            yield receipt
        except BaseException as exc:
            outcome, retry_after_s = outcome_of(exc)
            if outcome == "throttled" and not limits.adaptive_backoff:
                outcome = "refused"  # counted in the 429 share; no cut, no fleet-wide pause
            self.release(slot, outcome, ttl_ms=ttl_ms, retry_after_s=retry_after_s, limits=limits)
            raise
        drain = receipt.cost_usd / worst_usd if worst_usd else 0.0
        self.release(slot, "ok", ttl_ms=ttl_ms, limits=limits, drain=drain)

    def acquire(self, *, ttl_ms: int, limits: ThrottleLimits = NO_CAPS,
                keepalive: Callable[[], None] | None = None,
                warm: Callable[[int], None] | None = None) -> str:
        """Wait for a fleet-wide slot; returns its id. ``keepalive`` runs every KEEPALIVE_EVERY_S of
        waiting and may raise to give up (the dataset was stopped meanwhile)."""
        waiter = _Waiter(ttl_ms, limits, warm)
        self._queue.append(waiter)
        if self._pump is None:
            self._pump = gevent.spawn(self._run_pump)
        try:
            while not waiter.woken.wait(timeout=KEEPALIVE_EVERY_S):
                if keepalive is not None:
                    keepalive()
                if self._pump is None:  # it died of something unforeseen: the queue needs one
                    self._pump = gevent.spawn(self._run_pump)
        except BaseException:
            if waiter.granted:  # the slot came as we gave up: hand it back
                self.release(waiter.slot, "other", ttl_ms=ttl_ms, limits=limits)
            else:
                waiter.gone = True
            raise
        if waiter.error is not None:
            raise waiter.error
        return waiter.slot

    def _run_pump(self) -> None:
        try:
            while self._queue:
                if self._queue[0].gone:
                    self._queue.popleft()
                    continue
                self._freed.clear()  # before asking: a slot freed while Redis answers still wakes us
                head = self._queue[0]
                room, keep_free = self._room(head.limits)
                if room <= 0:  # this process's own cap: only a release here can make room
                    self._freed.wait(timeout=KEEPALIVE_EVERY_S)
                    continue
                # One call serves the waiters that ask alike (the same run's caps and TTL).
                batch = list(itertools.islice(
                    (w for w in self._queue if not w.gone and (w.limits, w.ttl_ms) == (head.limits, head.ttl_ms)),
                    room))
                try:
                    admission = self._throttle.acquire_many([w.slot for w in batch], ttl_ms=head.ttl_ms,
                                                            limits=head.limits, keep_free=keep_free)
                except Exception as exc:  # Redis down: those asking get the error, as a call of their own would
                    for w in batch:
                        self._hand_over(w, error=exc)
                    continue
                if admission.ok:
                    self.held += admission.granted
                    for w in batch[:admission.granted]:
                        self._hand_over(w)
                elif admission.why == "limit":
                    self._freed.wait(timeout=POLL_S * random.uniform(0.5, 1.5))
                elif admission.why == "hold":  # the run's plan is counting: its end starts the fleet's ramp
                    self._warm_while_held()
                    gevent.sleep(HOLD_POLL_S)
                else:  # a Retry-After pause or the rate bucket: the wait is known
                    gevent.sleep(admission.wait_ms / 1000)
        finally:
            self._pump = None

    def _room(self, limits: ThrottleLimits) -> tuple[int, int]:
        """How many slots to ask for now, and how many of the fleet's cap to leave free."""
        if self._cap is None:
            return MAX_BATCH, 0
        if self.held < self._cap:
            return min(MAX_BATCH, self._cap - self.held), 0
        cap = limits.max_in_flight
        if cap is None or self.held >= self._borrow_cap:
            return 0, 0
        return min(MAX_BATCH, self._borrow_cap - self.held), max(1, min(LEND_MARGIN, cap // 50))

    def _wants_back(self, releasing: int) -> bool:
        """Whether, once ``releasing`` slots are given back, this process is under its share with
        requests waiting: the release then marks the fleet wanting, or a borrower's poll could take
        the freed slots in the moment before this process's pump asks for them."""
        return self._cap is not None and bool(self._queue) and self.held - releasing < self._cap

    def _warm_while_held(self) -> None:
        """Each upstream opens the connections its held requests will use, so the whole first wave
        leaves at once when the plan passes, none of it connecting first."""
        for warm, waiting in Counter(w.warm for w in self._queue if w.warm is not None and not w.gone).items():
            try:
                warm(waiting)
            except Exception as exc:  # an optimisation: the requests connect for themselves
                log.debug("warming %d connections failed: %s", waiting, exc)

    def _hand_over(self, waiter: _Waiter, *, error: BaseException | None = None) -> None:
        self._queue.remove(waiter)
        if waiter.gone:  # gave up while Redis granted it: the slot goes back at once
            if error is None:
                self.release(waiter.slot, "other", ttl_ms=waiter.ttl_ms, limits=waiter.limits)
            return
        waiter.granted, waiter.error = error is None, error
        waiter.woken.set()

    def release(self, slot: str, outcome: SlotOutcome, *, ttl_ms: int, retry_after_s: float | None = None,
                limits: ThrottleLimits = NO_CAPS, drain: float = 0.0) -> None:
        """Never raises, and with batched releases never waits (a paid answer must not be lost to,
        nor held up by, a Redis blip): a slot Redis does not hear of expires by its TTL."""
        self._releases.append(Release(slot, outcome, ttl_ms, retry_after_s, limits, drain))
        if not self._batch_releases:
            self._flush()
        elif self._releaser is None:
            self._releaser = gevent.spawn(self._run_releaser)

    def _run_releaser(self) -> None:
        try:
            while self._releases:
                self._flush()
        finally:
            self._releaser = None

    def _flush(self) -> None:
        batch, self._releases = self._releases[:MAX_BATCH], self._releases[MAX_BATCH:]
        try:
            with deadline(RELEASE_WAIT_S):
                self._throttle.release_many(batch, wanting=self._wants_back(len(batch)))
        except Exception as exc:
            log.warning("throttle release of %d slot(s) failed (%s: %s); they expire by themselves",
                        len(batch), type(exc).__name__, exc)
        self.held -= len(batch)
        self._freed.set()
