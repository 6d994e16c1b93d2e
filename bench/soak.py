"""Chaos soak: a run that meets every fault at once, and the figures that say nothing was lost.

    .venv/bin/python -m bench.soak                                  # make soak: 10,000 prompts
    .venv/bin/python -m bench.soak --prompts 1500 --concurrency 20  # smaller, while developing

A private Valkey with AOF (appendfsync everysec) on a fixed port, the simulator with 5% each of
429, 502, hang, bad JSON and 200-with-error and 3% of trickling answers (a byte a second for
longer than the attempt's ``timeout_s``: cut by the deadline and asked again), worker processes of
which one is SIGKILLed and a new one started every 5–10 s (``--worker-kills`` of them, 8 by
default). The producer's idle-queue sweep is pushed out of the way (``--stall-s``) so a killed
worker's tasks can only come back by the visibility timeout. At set shares of the kept rows, one after the other:

- 10%: Redis SIGKILLed and started again 3 s later (same port and data);
- 20%: a dozen poison messages pushed into the active queue (harness/chaos.py): each must be
  dead-lettered, no worker may die of one;
- 30%: Redis refuses writes (``CONFIG SET maxmemory 1``, noeviction) for ``--refuse-s``;
- 45%: the producer frozen (SIGSTOP) past its lock's TTL; producer B started with the same command
  meanwhile; A resumed (SIGCONT) once B holds the lock: A must stop fenced (its one line, its exit
  code) and B carry the run to its end;
- 70%: Redis SIGKILLed again and, while it is down, one worker SIGTERMed: its time to exit is
  judged against the worker's documented stop bound (workers/fleet/stop.py); Redis comes back once it
  has exited, and a replacement worker starts.

Every worker process sends its own ``X-Title``, and the simulator's request log
(``/_sim/requests``) records who asked which prompt when; the ledger says which answers were
delivered. A prompt is *asked again* when a request for it starts after a delivered answer, or
comes from another worker than the previous request; the repeat is the killed worker's if the
worker that asked before was SIGKILLed after its request started, and anything else otherwise.
Billed = counted: the simulator's billed requests and dollars against the run's summary.json,
less what killed workers were asked but never lived to settle (a request open when its worker was
SIGKILLed; one answered in the seconds before is counted or not depending on whether its settle
landed first, so those bound the gap from above).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import requests

from common import keys
from common.budget import Budget
from common.throttle import FleetThrottle
from harness.chaos import RestartableValkey, poison_messages, read_shards
from harness.fleet import Fleet, write_jsonl
from simulator.seeding import prompt_hash

FAULTS = {"429": 0.05, "502": 0.05, "hang": 0.05, "bad_json": 0.05, "error200": 0.05, "trickle": 0.03}
#: Faults whose answer never reaches the client whole: their generation is billed, not delivered.
UNDELIVERED = ("bad_json", "hang", "trickle")
DATASET = "SOAK"
HANG_S = 8
TIMEOUT_S = 6
TRICKLE_EVERY_S, TRICKLE_S = 1.0, 15.0  # 15 s of trickle > the 6 s deadline: every one is cut
REDIS_DOWN_S = 3.0
#: An answer whose worker was SIGKILLed this soon after it arrived may or may not have been settled.
SETTLE_WINDOW_S = 5.0
#: The prompt's lease as workers/pipeline/job.py sizes it: 1.2 × timeout_s + backoff_max_s (0.5 in
#: harness/fleet.py's config) + 10 s.
LEASE_S = 1.2 * TIMEOUT_S + 0.5 + 10
#: A stopped worker's last line comes at its bound; the interpreter's exit after it, on a box with a
#: load of 10 on 2 cores, has taken a few tenths of a second more.
EXIT_SLACK_S = 2.0
#: A worker's line for a paid answer it put on disk instead of Redis: "<dataset>/<id> settle: … spooled to".
SPOOLED = re.compile(r"\S+/(\S+) (?:settle|fail)\b[^\n]*spooled to")
#: A worker's line for a prompt that failed (its attempts spent): "<dataset>/<id> failed: <reason> …".
FAILED = re.compile(r"\S+/(\S+) failed: ")


def _bound(module: str, name: str) -> float | None:
    """A product constant the soak judges against, or None where that part has not landed."""
    try:
        mod = __import__(module, fromlist=[name])
    except ImportError:
        return None
    value = getattr(mod, name, None)
    return float(value) if isinstance(value, int | float) else None


EXIT_FENCED = _bound("producer.execute", "EXIT_FENCED")
STOP_BOUND_S = _bound("workers.fleet.stop", "STOP_BOUND_S")
STOP_GRACE_S = _bound("workers.fleet.stop", "WRITES_GRACE_S") or 0.0
LOCK_TTL_S = _bound("producer.lock", "LOCK_TTL_S") or 10.0


def soak_prompts(n: int) -> list[dict[str, Any]]:
    return [{"id": f"s{i:06d}", "messages": [
        {"role": "user", "content": f"Soak case {i}: think it through, then answer — what is {i} mod 7? ✓"}]}
        for i in range(n)]


@dataclass
class Findings:
    """What each phase saw, for the figures."""

    phases: list[str] = field(default_factory=list)  # "<name> at <rows> rows, <t> s"
    skipped: list[str] = field(default_factory=list)  # phase: why (the product part it needs is missing)
    missed: list[str] = field(default_factory=list)  # phase: why (it should have run: the soak fails)
    poison: dict[str, bytes] = field(default_factory=dict)
    refused_s: float = 0.0
    frozen: dict[str, Any] = field(default_factory=dict)
    stop: dict[str, Any] = field(default_factory=dict)


class Chaos:
    """Kills a worker every 5–10 s (and starts another); the phases of the module docstring."""

    def __init__(self, fleet: Fleet, valkey: RestartableValkey, args: argparse.Namespace,
                 producer_cmd: list[str], producer_env: dict[str, str]) -> None:
        self.fleet, self.valkey, self.args = fleet, valkey, args
        self.producer_cmd, self.producer_env = producer_cmd, producer_env
        self.client = redis.Redis.from_url(valkey.url, socket_timeout=5)
        self.rng = random.Random(args.seed)
        self.live: list[str] = []
        self.worker_kills: list[tuple[float, str]] = []  # (time.time(), X-Title of the killed worker)
        #: Workers that exited with nobody asking: (time.time(), name, exit code); each is replaced, as a
        #: supervisor would, and counts against the soak.
        self.died: list[tuple[float, str, int]] = []
        self.redis_kills: list[float] = []
        #: (from, to) wall-clock windows in which Redis took no writes: SIGKILLed, or refusing them.
        self.outages: list[tuple[float, float]] = []
        self.found = Findings()
        self.producer: subprocess.Popen[bytes] | None = None  # the one whose exit ends the run
        #: Set while the producer is being swapped (A frozen, B starting): A's exit does not end the run.
        self.swapping = threading.Event()
        self.stop = threading.Event()
        self._n = 0
        self._rows = 0
        self.started_s = 0.0

    # --- workers -------------------------------------------------------------------------------

    def start_worker(self) -> None:
        self._n += 1
        name = f"soak-w{self._n:02d}"
        self.fleet.start_worker(name, concurrency=self.args.concurrency, SPECFLEET_APP_TITLE=name,
                                SPECFLEET_LOG_LEVEL=self.args.worker_log_level, **self.args.worker_env)
        self.live.append(name)

    def reap(self) -> None:
        for name in list(self.live):
            code = self.fleet.procs[name].poll()
            if code is not None:
                self.died.append((time.time(), name, code))
                self.live.remove(name)
                self.start_worker()

    def kill_worker(self) -> None:
        name = self.rng.choice(self.live)
        self.fleet.procs[name].send_signal(signal.SIGKILL)
        self.fleet.procs[name].wait()
        self.worker_kills.append((time.time(), name))
        self.live.remove(name)
        self.start_worker()

    # --- phases ----------------------------------------------------------------------------------

    def rows(self) -> int:
        with contextlib.suppress(redis.RedisError):  # Redis killed by the chaos: the last count
            self._rows = Budget(self.client, DATASET).snapshot().rows
        return self._rows

    def kill_redis(self) -> None:
        self.valkey.kill()
        self.redis_kills.append(time.time())
        time.sleep(REDIS_DOWN_S)
        self.valkey.start()
        self.outages.append((self.redis_kills[-1], time.time()))

    def push_poison(self) -> None:
        queue = keys.queue(DATASET)
        config_id = self.client.hget(keys.ACTIVE_QUEUES, queue)
        if config_id is None:
            self.found.missed.append("poison: the dataset's queue was not active")
            return
        self.found.poison = poison_messages(self.valkey.url, queue, config_id.decode(), DATASET, "s000001")
        # RPUSH: the BRPOP end, so they are taken next, between good messages.
        for raw in self.found.poison.values():
            self.client.rpush(queue, raw)

    def refuse_writes(self) -> None:
        original = self.client.config_get("maxmemory")["maxmemory"]
        self.client.config_set("maxmemory", 1)
        started, since = time.monotonic(), time.time()
        try:
            time.sleep(self.args.refuse_s)
        finally:
            self.client.config_set("maxmemory", original)
        self.found.refused_s = time.monotonic() - started
        self.outages.append((since, time.time()))

    def freeze_producer(self) -> None:
        a, f = self.producer, self.found.frozen
        assert a is not None
        self.swapping.set()
        try:
            a.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            f["rows_at_stop"] = self.rows()
            if not _wait(lambda: not self.client.exists(keys.PRODUCER_LOCK), 30 + LOCK_TTL_S):
                f["error"] = "A's lock never expired"
            f["lock_gone_s"] = time.monotonic() - stopped
            b = self.fleet._spawn("producer-B", self.producer_cmd, self.producer_env)
            f["b_pid"], f["b_started_at"] = b.pid, time.time()

            def b_holds() -> bool:
                holder = self.client.get(keys.PRODUCER_LOCK)
                return b.poll() is not None or (holder is not None and holder.decode().endswith(f":{b.pid}"))

            if not _wait(b_holds, 120) or b.poll() is not None:
                f["error"] = f"B never held the lock (B exit {b.poll()})"
            f["b_took_s"] = time.monotonic() - stopped
            time.sleep(max(0.0, self.args.freeze_s - (time.monotonic() - stopped)))
            self.producer = b
            f["frozen_s"] = time.monotonic() - stopped
            f["rows_at_resume"] = self.rows()
            f["b_running_at_resume"] = b.poll() is None
        finally:
            a.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        try:
            f["a_exit"] = a.wait(timeout=120)
        except subprocess.TimeoutExpired:
            f["a_exit"] = None  # still running: it did not stop fenced (ended with the fleet)
        f["a_exit_after_s"] = time.monotonic() - resumed
        lines = [ln for ln in self.fleet.log("producer").splitlines() if ln.startswith("specfleet:")]
        f["a_lines"] = lines
        self.swapping.clear()

    def kill_redis_and_stop_worker(self) -> None:
        s = self.found.stop
        if STOP_BOUND_S is None:
            self.found.skipped.append("stop while Redis is down: workers/fleet/stop.py (the stop bound) has not landed")
            self.kill_redis()
            return
        self.valkey.kill()
        killed = time.monotonic()
        self.redis_kills.append(time.time())
        time.sleep(2)  # a worker told to stop that has already met the outage
        # A worker that is up (Celery's handlers installed): one started a moment ago by the chaos
        # would die of the signal's default action and measure nothing.
        ready = [n for n in self.live if "ready." in self.fleet.log(n)]
        name = self.rng.choice(ready or self.live)
        self.live.remove(name)
        proc = self.fleet.procs[name]
        s["worker"], s["term_at"] = name, time.time()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            s["exit"] = proc.wait(timeout=STOP_BOUND_S + STOP_GRACE_S + 30)
        except subprocess.TimeoutExpired:
            s["exit"] = None
            proc.kill()
            proc.wait()
        s["stop_s"], s["exited_at"] = time.monotonic() - sent, time.time()
        s["redis_down_throughout"] = True  # Redis stays down until the worker is gone
        time.sleep(max(0.0, REDIS_DOWN_S - (time.monotonic() - killed)))
        self.valkey.start()
        s["redis_down_s"] = time.monotonic() - killed
        self.outages.append((self.redis_kills[-1], time.time()))
        self.start_worker()

    def run(self) -> None:
        # The clock starts once rows land: workers loading their tokenizer are not "mid-run".
        n = self.args.prompts
        while self.alive() and self.rows() < 50:
            time.sleep(0.2)
        self.started_s = time.time()
        started = time.monotonic()
        phases: list[tuple[float, str, Callable[[], None]]] = [
            (0.10, "Redis SIGKILL", self.kill_redis),
            (0.20, "poison messages", self.push_poison),
            (0.30, "Redis refuses writes", self.refuse_writes),
            (0.45, "frozen producer + producer B", self.freeze_producer),
            (0.70, "Redis SIGKILL + worker SIGTERM", self.kill_redis_and_stop_worker),
        ]
        next_worker_kill = started + self.rng.uniform(5, 10)
        while not self.stop.is_set() and self.alive():
            self.reap()
            now = time.monotonic()
            rows = self.rows()
            if phases and rows >= phases[0][0] * n:
                _, name, phase = phases.pop(0)
                self.found.phases.append(f"{name} at {rows:,} rows ({now - started:.0f} s)")
                phase()
                # A worker killed right on a phase's heels would be counted as the phase's doing.
                next_worker_kill = max(next_worker_kill, time.monotonic() + 3)
            elif now >= next_worker_kill and rows < 0.9 * n and len(self.worker_kills) < self.args.worker_kills:
                self.kill_worker()
                next_worker_kill = now + self.rng.uniform(5, 10)
            time.sleep(0.2)
        self.found.missed += [f"{name}: the run ended before {share:.0%} of the rows" for share, name, _ in phases]

    def alive(self) -> bool:
        return self.swapping.is_set() or (self.producer is not None and self.producer.poll() is None)


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except redis.RedisError:
            pass
        time.sleep(0.1)
    return False


class ThrottleWatch(threading.Thread):
    """The fleet throttle's state once a second (the random 429s must not hold the fleet back)."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.throttle = FleetThrottle(client)
        self.samples: list[tuple[float | None, bool, float]] = []  # (limit, paused, background share)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(1.0):
            try:
                snap = self.throttle.snapshot()
            except redis.RedisError:  # Redis SIGKILLed by the chaos: no sample
                continue
            self.samples.append((snap.limit, snap.pause_ms_left > 0, snap.background_share))

    def line(self, greenlets: int) -> str:
        n = len(self.samples)
        if not n:
            return "throttle: no samples"
        limits = [limit for limit, _, _ in self.samples if limit is not None]
        held = sum(1 for limit in limits if limit < 0.9 * greenlets)
        paused = sum(1 for _, p, _ in self.samples if p)
        lowest = f" (lowest {min(limits):.0f})" if limits else ""
        return (f"throttle: limit under 90% of the fleet's {greenlets} greenlets {100 * held / n:.0f}% of the time"
                f"{lowest}, fleet paused {100 * paused / n:.0f}% of the time, background 429 share at the end "
                f"{100 * self.samples[-1][2]:.1f}%")


KILLED = "killed worker's in-flight request"
STOPPED = "stopped worker's prompt left at its bound"
STOPPED_PAID = "stopped worker's paid answer left at its bound"
REDIS_KILLED = "answered just before a Redis SIGKILL"
RERUN = "failed, then asked again by producer B's run (a rerun retries failed prompts)"
PARTITION = "held across a Redis outage longer than its lease (README: the lease bound)"
OVERLAP = "asked by another worker while an attempt of it was open"
SWEPT = "re-enqueued by the producer's idle-queue sweep (its message lost with a Redis SIGKILL)"
READ_LATE = "sent whole within timeout_s, its worker asked again (read after its deadline)"
ELSE = "anything else"
#: Causes a repeat may have: the worker that asked before died (SIGKILL) or left it (its stop bound).
EXPECTED = (KILLED, STOPPED, RERUN, PARTITION, SWEPT)


@dataclass
class Ends:
    """When each worker the chaos ended stopped settling, and when Redis took no writes."""

    kills: dict[str, float]  # worker -> SIGKILL (wall clock)
    stopped: dict[str, tuple[float, float]]  # worker -> (SIGTERM, exit)
    spooled: set[str]  # prompt ids the stopped worker spooled (counted once replayed)
    outages: list[tuple[float, float]]
    redis_kills: list[float]
    #: When producer B started (a run started again gives the prompts that failed another chance),
    #: and the prompts some worker said had failed.
    rerun_at: float | None = None
    failed_once: set[str] = field(default_factory=set)
    #: When the producer's idle-queue sweep re-enqueued prompts that had no outcome.
    sweeps: list[float] = field(default_factory=list)

    def lease_lapsed(self, earlier: list[dict[str, Any]], cur_start_s: float, visibility_s: float) -> bool:
        """The prompt was held (a request of it ended at most LEASE_S before) when Redis went down for
        longer than the lease, so the lease ran out meanwhile, and the repeat came once Redis was
        back, before the prompt's message could have come back by the visibility timeout twice."""
        return any(b - a > LEASE_S and b - 1 <= cur_start_s <= b + visibility_s + LEASE_S
                   and any(a - LEASE_S <= (r["end_s"] or b) <= b for r in earlier)
                   for a, b in self.outages)

    def writable_s(self, start: float, end: float) -> float:
        """Seconds of [start, end] in which Redis took writes (a settle could land)."""
        span = max(0.0, end - start)
        return span - sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.outages)

    def left(self, app: str, end_s: float | None, *, answered: bool = True) -> tuple[str, bool] | None:
        """(KILLED | STOPPED, sure) if a request of ``app`` that ended at ``end_s`` was still the
        worker's when it died or stopped: open then (sure), or answered so shortly before, counting
        only time Redis took writes, that its settle may not have landed. ``answered=False`` (an
        attempt that failed): its prompt stays the worker's until its next attempt, however long
        the backoff, the throttle or Redis keep it waiting."""
        for cause, at in ((KILLED, self.kills.get(app)), (STOPPED, (self.stopped.get(app) or (None, None))[0])):
            if at is None:
                continue
            if end_s is None or end_s >= at:
                return cause, True
            if not answered or self.writable_s(end_s, at) < SETTLE_WINDOW_S:
                return cause, False
        return None

    def before_redis_kill(self, end_s: float | None) -> bool:
        return end_s is not None and any(0 <= t - end_s < 1.5 for t in self.redis_kills)


def _log_time(date_s: str, ms: str) -> float:
    return time.mktime(time.strptime(date_s, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000  # logging's local time


def sweep_times(producer_log: str) -> list[float]:
    return [_log_time(d, ms) for d, ms in re.findall(
        r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .* re-enqueued \d+", producer_log, re.M)]


def run_started_at(producer_log: str) -> float | None:
    """When a producer started the dataset's run (its "<ds>: start (" line, after it cleared the
    failures of the runs before): from then on a prompt that had failed is asked again."""
    m = re.search(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{{3}}) \w+ \S+ [\w.]+: {DATASET}: start \(",
                  producer_log, re.M)
    if m is None:
        return None
    return _log_time(m[1], m[2])


def asked_twice(records: list[dict[str, Any]], delivered: set[str], ends: Ends, hash_to_id: dict[str, str],
                timeout_s: float = TIMEOUT_S, visibility_s: float = 40,
                read_late: set[str] | None = None) -> tuple[Counter[str], list[float], dict[str, list[str]]]:
    """Repeats by cause, the delay from each worker kill to its prompts being asked again, examples.
    ``read_late`` gets the generations sent whole in time that their worker gave up on."""
    by_prompt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["prompt"] in hash_to_id:
            by_prompt[r["prompt"]].append(r)
    causes: Counter[str] = Counter()
    delays: list[float] = []
    examples: dict[str, list[str]] = defaultdict(list)
    for h, reqs in by_prompt.items():
        reqs.sort(key=lambda r: r["start_s"])
        answered_at: float | None = None  # end of the first answer its client received
        for i, (prev, cur) in enumerate(itertools.pairwise(reqs)):
            if prev["gen_id"] in delivered:
                answered_at = prev["end_s"] if answered_at is None else min(answered_at, prev["end_s"])
            again = cur["app"] != prev["app"] or (answered_at is not None and answered_at <= cur["start_s"])
            if not again:
                continue
            left = ends.left(prev["app"], prev["end_s"], answered=prev["gen_id"] in delivered)
            # The worker gives an attempt up at timeout_s (from a little before the simulator's start).
            open_until = min(prev["end_s"] or cur["start_s"], prev["start_s"] + timeout_s)
            if left is None and cur["app"] != prev["app"] and cur["start_s"] + 0.5 < open_until:
                cause = OVERLAP
            elif (ends.rerun_at is not None and prev["start_s"] < ends.rerun_at <= cur["start_s"]
                    and hash_to_id[h] in ends.failed_once):
                cause = RERUN
            elif left is not None and left[0] == KILLED:
                cause = KILLED
                delays.append(cur["start_s"] - ends.kills[prev["app"]])
            elif left is not None:
                paid = prev["gen_id"] in delivered and hash_to_id[h] not in ends.spooled
                cause = STOPPED_PAID if paid else STOPPED
            elif prev["gen_id"] in delivered and ends.before_redis_kill(prev["end_s"]):
                cause = REDIS_KILLED
            elif ends.lease_lapsed(reqs[:i + 1], cur["start_s"], visibility_s):
                cause = PARTITION
            elif prev["gen_id"] not in delivered and any(-2 <= cur["start_s"] - t < 30 for t in ends.sweeps):
                # DESIGN: the sweep is the backstop for a message a Redis SIGKILL lost between the
                # BRPOP and its unacked record; the attempts before it were not answered. (-2 s: the
                # sweep logs its line after its push.)
                cause = SWEPT
            elif (prev["gen_id"] in delivered and cur["app"] == prev["app"]
                  and prev["end_s"] - prev["start_s"] < timeout_s):
                # Sent whole within timeout_s, yet its worker gave the attempt up at its deadline
                # (which starts before the request reaches the upstream): it read the socket too
                # late, its hub held by something else or starved of CPU.
                cause = READ_LATE
                if read_late is not None:
                    read_late.add(prev["gen_id"])
            else:
                cause = ELSE
            causes[cause] += 1
            examples[cause].append(hash_to_id[h])
            answered_at = None
    return causes, delays, examples


@dataclass
class Billing:
    """Every billed answer of the simulator's ledger, by what became of it in the fleet."""

    n: Counter[str] = field(default_factory=Counter)
    usd: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    unseen_by_fault: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, cost: float) -> None:
        self.n[kind] += 1
        self.usd[kind] += cost


KEPT, RECEIVED, UNSEEN, LATE = "kept", "received", "unseen", "late"
DEAD_SURE, DEAD_MAYBE, STOP_LEFT = "dead", "dead_maybe", "stop_left"


def billing(generations: list[dict[str, Any]], records: list[dict[str, Any]], kept_gens: set[str], ends: Ends,
            hash_to_id: dict[str, str], delivered: set[str], read_late: set[str]) -> Billing:
    """``kept``: a row's answer; ``received``: an answer a live worker had whole (a duplicate, a
    failure), which it must count; ``unseen``: billed but never whole in a worker (cut by the
    attempt's deadline, a body cut short): no usage ever reached the fleet; ``dead``/``dead_maybe``:
    a SIGKILLed worker's, surely or maybe never settled; ``stop_left``: the stopped worker's, not
    spooled (left at its bound); ``late``: sent whole within timeout_s, given up by its worker at its
    deadline (read too late: a repeat of its prompt is a failure of its own)."""
    by_gen = {r["gen_id"]: r for r in records if r["gen_id"]}
    out = Billing()
    for g in generations:
        cost, r = float(g["cost"]), by_gen.get(g["id"])
        if g["id"] in kept_gens:
            out.add(KEPT, cost)
            continue
        left = ends.left(r["app"], r["end_s"]) if r is not None else None
        if left is not None and left[0] == KILLED:
            out.add(DEAD_SURE if left[1] else DEAD_MAYBE, cost)
        elif g["id"] in read_late:
            out.add(LATE, cost)
        elif g["id"] not in delivered:
            out.add(UNSEEN, cost)
            out.unseen_by_fault[g["fault"] or ("abandoned" if g["abandoned"] else "past timeout_s")] += 1
        elif left is not None and hash_to_id.get(g["prompt_hash"]) not in ends.spooled:
            out.add(STOP_LEFT, cost)
        else:
            out.add(RECEIVED, cost)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--visibility-timeout-s", type=int, default=40)
    ap.add_argument("--restore-s", type=float, default=5.0)
    ap.add_argument("--latency-median-ms", type=int, default=1000)
    # A new worker takes 10-20 s to load on a busy box: kills without an end would leave the fleet
    # mostly starting, the run longer, and longer runs more kills.
    ap.add_argument("--worker-kills", type=int, default=8, help="worker SIGKILLs at most, one every 5-10 s")
    ap.add_argument("--refuse-s", type=float, default=15.0, help="how long Redis refuses writes")
    ap.add_argument("--freeze-s", type=float, default=15.0, help="how long the producer is frozen (> its lock TTL)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--worker-log-level", default="WARNING", help="INFO: one line per task step, for a post-mortem")
    ap.add_argument("--timeout-s", type=float, default=900, help="give up on the run after this long")
    args = ap.parse_args()
    args.worker_env = {"SPECFLEET_VISIBILITY_TIMEOUT_S": str(args.visibility_timeout_s),
                       "SPECFLEET_UNACKED_RESTORE_S": str(args.restore_s)}

    tmp = Path(tempfile.mkdtemp(prefix="specfleet-soak-"))
    valkey = RestartableValkey(tmp / "valkey")
    valkey.start()
    fleet = Fleet(tmp, valkey.url)
    client = redis.Redis.from_url(valkey.url, socket_timeout=30)
    items = soak_prompts(args.prompts)
    watch = ThrottleWatch(client)
    t0 = time.time()
    try:
        fault_args = [a for f, rate in FAULTS.items() for a in ("--fault", f"{f}={rate}")]
        # hang holds past the attempt's deadline: the worker gives up and retries (and is billed).
        fleet.start_simulator("--latency-median-ms", str(args.latency_median_ms), "--hang-s", str(HANG_S),
                              "--trickle-every-s", str(TRICKLE_EVERY_S), "--trickle-s", str(TRICKLE_S), *fault_args)
        data = write_jsonl(tmp / "soak.jsonl", items)
        config = fleet.write_config([{"name": DATASET, "path": data, "length": "short",
                                      "budget_tokens": 1_000_000_000}], timeout_s=TIMEOUT_S, estimate_tokens=600)
        cmd = [sys.executable, "-m", "producer.cli", "run", str(config), "--no-progress", "--stall-s", "150"]
        env = fleet.env(SPECFLEET_VISIBILITY_TIMEOUT_S=str(args.visibility_timeout_s))
        chaos = Chaos(fleet, valkey, args, cmd, env)
        for _ in range(args.workers):
            chaos.start_worker()
        time.sleep(3)
        chaos.producer = fleet._spawn("producer", cmd, env)
        watch.start()
        chaos_thread = threading.Thread(target=chaos.run, daemon=True)
        chaos_thread.start()
        deadline = time.monotonic() + args.timeout_s
        while chaos.alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        chaos.stop.set()
        chaos_thread.join(timeout=300)
        final = chaos.producer
        exit_code = final.poll()
        if exit_code is None:  # given up on
            final.kill()
            final.wait()
            exit_code = -1
        watch.halt.set()
        wall_s = time.time() - t0
        sim = fleet.sim_url
        records = requests.get(sim + "/_sim/requests", timeout=60).json()["requests"]
        ledger = requests.get(sim + "/_sim/stats?detail=1", timeout=60).json()
        rows, torn = read_shards(fleet.out, DATASET)
        budget = Budget(client, DATASET).snapshot()
        done = {m.decode() for m in client.smembers(keys.DatasetKeys(DATASET).done)}
        dead = [json.loads(e) for e in client.lrange(keys.DEAD_LETTERS, 0, -1)]
        failed_lines = (fleet.out / DATASET / "failed.jsonl")
        failures = [json.loads(x) for x in failed_lines.read_text().splitlines()] if failed_lines.exists() else []
        summary_path = fleet.out / DATASET / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        checkpoint_path = fleet.out / DATASET / ".checkpoint.json"
        checkpoint = json.loads(checkpoint_path.read_text()) if checkpoint_path.exists() else {}
        producer_b_log = fleet.log("producer-B")
        producer_logs = fleet.log("producer") + producer_b_log
        sweeps = producer_logs.count("re-enqueued")
        worker_names = [n for n in fleet.procs if n.startswith("soak-w")]
        worker_logs = {n: fleet.log(n) for n in worker_names}
        chaos.reap()
        died = [f"{name} (exit {code})" for _, name, code in chaos.died]
        (tmp / "requests.json").write_text(json.dumps(records))  # for a post-mortem
        (tmp / "ledger.json").write_text(json.dumps(ledger))
        (tmp / "kills.json").write_text(json.dumps({"workers": chaos.worker_kills, "redis": chaos.redis_kills,
                                                    "outages": chaos.outages, "stopped": chaos.found.stop,
                                                    "frozen": chaos.found.frozen, "died": chaos.died}))
    finally:
        fleet.stop_all()
        valkey.stop()

    found = chaos.found
    generations = ledger.get("generations", [])
    # Whole at the simulator, and within the attempt's deadline (which starts at the worker, before
    # the request reaches the simulator): an answer that took timeout_s or more was cut at the worker.
    took = {r["gen_id"]: (r["end_s"] or 0) - r["start_s"] for r in records if r["gen_id"]}
    delivered = {g["id"] for g in generations if not g["abandoned"] and g["fault"] not in UNDELIVERED
                 and took.get(g["id"], 0) < TIMEOUT_S}
    stop = found.stop
    stopped = {stop["worker"]: (stop["term_at"], stop["exited_at"])} if stop.get("worker") else {}
    spooled = set(SPOOLED.findall(worker_logs.get(stop.get("worker", ""), "")))
    failed_once = {pid for log in worker_logs.values() for pid in FAILED.findall(log)}
    ends = Ends({name: t for t, name in chaos.worker_kills}, stopped, spooled, chaos.outages, chaos.redis_kills,
                run_started_at(producer_b_log), failed_once, sweep_times(producer_logs))
    hash_to_id = {prompt_hash(p["messages"]): p["id"] for p in items}
    read_late: set[str] = set()
    causes, delays, examples = asked_twice(records, delivered, ends, hash_to_id,
                                           visibility_s=args.visibility_timeout_s, read_late=read_late)
    ids = Counter(r["id"] for r in rows)
    failed_ids = {f["id"] for f in failures}
    without = len(set(hash_to_id.values()) - set(ids) - failed_ids)
    duplicates = sum(c - 1 for c in ids.values() if c > 1)
    lost = sorted(done - set(ids))
    by_reason = Counter(f["reason"] for f in failures)
    kept_tokens = sum(int(r["num_tokens"]) for r in rows)
    unrecoverable = sum(log.count("Unrecoverable error") for log in worker_logs.values())
    tracebacks = sum(log.count("Traceback") for log in worker_logs.values())

    print(f"soak: {args.prompts:,} prompts, {len(chaos.worker_kills) + args.workers + bool(stopped)} worker "
          f"processes ({len(chaos.worker_kills)} SIGKILLed, {len(stopped)} SIGTERMed), Redis SIGKILLed "
          f"{len(chaos.redis_kills)}× (at {', '.join(f'{t - chaos.started_s:.0f}' for t in chaos.redis_kills)} s "
          f"after the first rows), faults {', '.join(f'{f} {100 * r:g}%' for f, r in FAULTS.items())} "
          f"(trickle {TRICKLE_S:g} s > timeout_s {TIMEOUT_S}); visibility timeout {args.visibility_timeout_s} s, "
          f"unacked restore every {args.restore_s:g} s")
    print("phases: " + "; ".join(found.phases))
    for why in found.skipped:
        print(f"phase skipped: {why}")
    for why in found.missed:
        print(f"phase MISSED: {why}")
    print(f"prompts kept: {len(ids):,} · failed: {len(failed_ids):,} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(by_reason.items())) or '-'}) · without outcome: {without}")
    print(f"duplicate rows: {duplicates} · rows lost (in Redis' done set, not on disk): {len(lost)}"
          + (f" (e.g. {', '.join(lost[:5])})" if lost else "")
          + f" · torn lines: {torn} · checkpoint rows {checkpoint.get('rows', '?')} over {len(rows):,} lines")
    print("prompts asked twice: " + " · ".join(
        f"{cause} {causes[cause]}" + (f" (e.g. {', '.join(examples[cause][:4])})"
                                      if causes[cause] and cause not in EXPECTED else "")
        for cause in (KILLED, STOPPED, RERUN, PARTITION, SWEPT, OVERLAP, STOPPED_PAID, REDIS_KILLED, READ_LATE,
                      ELSE)))
    unexpected = sum(n for cause, n in causes.items() if cause not in EXPECTED)
    counter_kept, counter_rows = budget.kept_tokens, budget.rows
    same = counter_kept == kept_tokens and counter_rows == len(rows)
    print(f"budget counter: kept {counter_kept:,} tokens in {counter_rows:,} rows · rows on disk: "
          f"{kept_tokens:,} tokens in {len(rows):,} rows · {'equal' if same else 'DIFFERENT'}")

    # Billed = counted: every answer a live worker had whole is in the summary; what no worker had
    # whole (cut by the deadline or mid-body), or a dead one never settled, is listed apart.
    kept_gens = {str(r.get("generation_id", "")) for r in rows}
    b = billing(generations, records, kept_gens, ends, hash_to_id, delivered, read_late)
    billed_n, billed_usd = int(ledger.get("billed_requests", 0)), float(ledger.get("billed_cost_usd", 0.0))
    counted_n = int(summary.get("requests", -1))
    counted_usd = float(summary.get("spent_usd") or summary.get("cost_usd") or 0.0)
    want_n, want_usd = b.n[KEPT] + b.n[RECEIVED], b.usd[KEPT] + b.usd[RECEIVED]
    usd_slack = 1e-6 * max(1, billed_n)  # the simulator rounds each answer's cost
    billed_ok = (want_n <= counted_n <= want_n + b.n[DEAD_MAYBE]
                 and want_usd - usd_slack <= counted_usd <= want_usd + b.usd[DEAD_MAYBE] + usd_slack)

    def part(kind: str) -> str:
        return f"{b.n[kind]:,} ${b.usd[kind]:.6f}"

    print(f"billed (simulator's ledger, /_sim/stats?detail=1): {billed_n:,} requests ${billed_usd:.6f} = kept rows "
          f"{part(KEPT)} + other answers live workers had whole {part(RECEIVED)} + never whole "
          f"in a worker (cut by the deadline or mid-body: no usage reached the fleet) {part(UNSEEN)} ("
          f"{', '.join(f'{k} {v}' for k, v in sorted(b.unseen_by_fault.items()))}) + SIGKILLed "
          f"workers' unsettled "
          f"{part(DEAD_SURE)} (+ {part(DEAD_MAYBE)} answered just before the kill) + left by the stopped worker "
          f"{part(STOP_LEFT)} + sent whole in time, given up at the worker's deadline {part(LATE)}")
    print(f"summary billed: {counted_n:,} requests ${counted_usd:.6f} · against the answers live workers had whole "
          f"{want_n:,} ${want_usd:.6f}"
          + (f" (up to {b.n[DEAD_MAYBE]} more)" if b.n[DEAD_MAYBE] else "")
          + f": {'billed = counted' if billed_ok else 'BILLED ≠ COUNTED'} · against all billed: "
          f"{billed_n - counted_n:,} requests ${billed_usd - counted_usd:.6f} short")

    dead_reasons = Counter(str(e.get("reason")) for e in dead)
    pushed = len(found.poison)
    print(f"poison: {pushed} pushed · dead-lettered {len(dead)} "
          f"({', '.join(f'{k} {v}' for k, v in sorted(dead_reasons.items())) or '-'}) · summary dead_letters "
          f"{summary.get('dead_letters', '?')} · 'Unrecoverable error' in worker logs: {unrecoverable} · "
          f"tracebacks {tracebacks} · workers that died on their own: {len(died)}"
          + (f" ({', '.join(died)})" if died else ""))
    refusal_lines = sum(log.count("refuses writes") for log in worker_logs.values())
    print(f"Redis refused writes for {found.refused_s:.1f} s: workers said so in {refusal_lines} lines, the producer "
          f"in {producer_logs.count('refuses writes')}")

    f = found.frozen
    fenced_ok = True
    if f:
        a_line = f["a_lines"][-1] if f["a_lines"] else "(no specfleet: line)"
        fenced_ok = (EXIT_FENCED is not None and f["a_exit"] == EXIT_FENCED and len(f["a_lines"]) == 1
                     and "error" not in f)
        print(f"frozen producer: A SIGSTOPped {f.get('frozen_s', 0):.1f} s at {f['rows_at_stop']:,} rows (lock gone "
              f"after {f.get('lock_gone_s', 0):.1f} s, B held it {f.get('b_took_s', 0):.1f} s after the stop, "
              f"B {'running' if f.get('b_running_at_resume') else 'ended'} when A resumed at "
              f"{f.get('rows_at_resume', 0):,} rows) · A exit {f['a_exit']} (fenced = {EXIT_FENCED:g}) "
              f"{f['a_exit_after_s']:.1f} s after SIGCONT, {len(f['a_lines'])} specfleet: line(s): {a_line}"
              + (f" · {f['error']}" if "error" in f else "") + f" · B exit {exit_code}")
    else:
        print(f"frozen producer: not run · producer exit {exit_code}")

    s = found.stop
    stop_ok = True
    if s:
        limit = (STOP_BOUND_S or 0) + STOP_GRACE_S
        # Exit 0: the worker's own stop ran (a negative status is the signal's default action).
        stop_ok = s["exit"] == 0 and s["stop_s"] <= limit + EXIT_SLACK_S
        verdict = "within it" if s["stop_s"] <= limit else f"over it by {s['stop_s'] - limit:.1f} s"
        print(f"worker SIGTERMed 2 s into a Redis outage: exited {s['exit']} after {s['stop_s']:.1f} s "
              f"(bound {STOP_BOUND_S:g} s + {STOP_GRACE_S:g} s for spool writes, workers/fleet/stop.py) {verdict}"
              f"{'' if stop_ok else ' past the allowance'} (judged with {EXIT_SLACK_S:g} s for the process to end "
              f"on a busy box); Redis down {s['redis_down_s']:.1f} s in all")

    if delays:
        print(f"redelivery after a worker kill (kill → asked again): median {statistics.median(delays):.1f} s, "
              f"max {max(delays):.1f} s over {len(delays)} prompts; bound visibility "
              f"{args.visibility_timeout_s} s + restore {args.restore_s:g} s + pickup")
    else:
        print("redelivery after a worker kill: no killed worker had a request in flight")
    print(watch.line(args.workers * args.concurrency))
    print(f"requests {len(records):,} · billed {billed_n:,} · idle-queue sweeps "
          f"{sweeps} · end {summary.get('end_reason', '?')} · wall time {wall_s:.1f} s · dir {tmp}")
    ok = (exit_code == 0 and without == 0 and duplicates == 0 and not lost and torn == 0
          and unexpected == 0 and same and billed_ok and fenced_ok and stop_ok
          and unrecoverable == 0 and not died and len(dead) >= pushed and not found.missed)
    skips = f" ({len(found.skipped)} phase(s) skipped: see above)" if found.skipped else ""
    print(("soak: OK" if ok else "soak: FAILED") + skips)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
