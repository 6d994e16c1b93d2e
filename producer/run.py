"""A run: the config's datasets in order, each enqueued, watched and stopped on its budget.

A dataset ends its admission when the budget script marks it exhausted (the next request would not
fit), or when every prompt has an outcome. Then its queue leaves ``specfleet:active`` and is purged,
and the next dataset starts at once; the ended one drains in the background (admitted requests are
paid for, so they land) and is finalized — summary.json, failed.jsonl — when nothing is in flight.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import redis
from celery import Celery

from common import keys
from common.budget import Budget, open_run
from common.config import DatasetConfig, RunConfig
from common.contract import CONTRACT_VERSION, FOLLOW_COMMAND, TaskPayload, conversation_of, halt_line
from common.datasets import Prompt, ReadStats, read_prompts
from common.errors import (
    ConfigError,
    DatasetRowError,
    Halted,
    Interrupted,
    ProducerFenced,
    RedisRefusesWrites,
    SpecfleetError,
)
from common.redis_client import CLOCK, RedisOutage
from common.stats import DatasetStats
from common.throttle import FleetThrottle
from producer.collector import Collector
from producer.enqueue import push
from producer.lock import ProducerLock
from producer.plan import PendingPlan
from producer.refusals import WriteHold
from producer.rows import RowWriter, atomic_write, disk_generation, output_error
from producer.state import DatasetState, read_state
from producer.summary import Summary, report_line, summary_counts, throttle_summary

log = logging.getLogger(__name__)

ENQUEUE_BATCH = 1000
TICK_S = 0.25
SAMPLE_EVERY_S = 1.0
REAP_EVERY_S = 5.0
#: The tick proves the lock ours first when it was last proved longer ago than this (a pause).
LOCK_CHECK_EVERY_S = 1.0
#: How often "Redis unreachable, retrying (n s)" is shown while Redis is away.
OUTAGE_NOTICE_EVERY_S = 5.0

#: End reasons by the limit that exhausted a dataset (BudgetSnapshot.ended_by); these leave
#: admitted requests to land, where other end reasons stop them.
BUDGET_END_REASONS = {"tokens": "budget", "usd": "budget_usd", "run_usd": "run_budget"}


@dataclass
class Tuning:
    """Timings a test may shorten; the defaults suit a real run."""

    #: Queue empty and nothing in flight this long, with prompts lacking an outcome: re-enqueue them.
    stall_s: float = 60.0
    max_sweeps: int = 3
    #: How long an ended dataset may drain its admitted requests before it is finalized anyway.
    drain_timeout_s: float = 4 * 3600.0
    #: Rounds that refill the room a budget stop left (see Runner._top_up).
    max_top_ups: int = 3


@dataclass
class DatasetRun:
    cfg: DatasetConfig
    budget: Budget
    started_s: float = field(default_factory=time.time)
    prompts: int = 0  # good prompts in the file (up to max_prompts)
    malformed: int = 0
    enqueued: int = 0
    resumed_rows: int = 0
    end_reason: str = ""
    admission_ended_s: float | None = None
    #: When admission first ended (top-up rounds end it again later), and the rows kept by then.
    first_stop_s: float | None = None
    rows_at_first_stop: int | None = None
    finished_s: float | None = None
    sweeps: int = 0
    enqueue_done: bool = False
    top_ups: int = 0
    #: The state it was finalized with: what progress keeps showing for a finished dataset.
    final_state: DatasetState | None = None
    idle_since_s: float | None = None
    switch_s: float | None = None
    enqueue_s: float | None = None
    summary: Summary | None = None

    @property
    def name(self) -> str:
        return self.cfg.name


class Runner:
    def __init__(
        self,
        cfg: RunConfig,
        client: redis.Redis,
        app: Celery,
        *,
        progress: Any = None,
        tuning: Tuning | None = None,
        plan: PendingPlan | None = None,
    ) -> None:
        """``plan``: the plan still counting (``producer/plan.py``): prompts are queued and workers
        prepare them meanwhile, and no request starts until it passes."""
        self.cfg = cfg
        self.client = client
        self.app = app
        self.progress = progress
        self.tuning = tuning or Tuning()
        self.config_id = cfg.config_id()
        self.out_dir = cfg.output.dir
        self._interrupted = threading.Event()
        #: Every write of the producer waits out a Redis that refuses writes (full, a replica).
        self.hold = WriteHold(retry_window_s(client), where(client), notice=self._show,
                              abort=self._interrupted.is_set)
        self.lock = ProducerLock(client, self.hold)
        self.collector = Collector(client, self.out_dir, cfg.output.shard_rows, fence=self.lock)
        self.throttle = FleetThrottle(client)
        self._runs: list[DatasetRun] = []
        self._last_sample_s = 0.0
        self._last_reap_s = 0.0
        self._outages_seen = 0
        self._outage_shown: tuple[int, float | None] = (-1, None)
        self._outage_shown_s = 0.0
        self._plan = plan
        self._plan_passed = plan is None
        self._started_s = time.monotonic()
        #: Leases of every dataset at the last sample: the first wave has left once they stop growing.
        self._last_in_flight = 0

    @property
    def interrupted(self) -> bool:
        """SIGTERM/SIGINT arrived: the run is stopping."""
        return self._interrupted.is_set()

    def wait_interrupted(self) -> None:
        """Until SIGTERM/SIGINT arrives."""
        self._interrupted.wait()

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> list[Summary]:
        missing = [f"datasets[{i}] ({d.name}).path: {d.path}: no such file"
                   for i, d in enumerate(self.cfg.datasets) if not d.path.is_file()]
        if missing:  # before anything is enqueued: a typo in the third dataset must not wait hours
            raise ConfigError("dataset files missing\n  " + "\n  ".join(missing))
        self.cfg.require_prices()
        # Above the generation that wrote any of the folders: a Redis that lost its counter
        # must not hand out a generation the folders would take for an old producer's.
        self.lock.acquire(max((disk_generation(self.out_dir / d.name) for d in self.cfg.datasets), default=0))
        self._install_signal_handlers()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise output_error(self.out_dir, exc) from None
        hold = self.hold
        hold(lambda: self.client.set(keys.config(self.config_id), self.cfg.worker_view().model_dump_json()))
        if hold(lambda: self.client.delete(keys.HALT)):
            log.warning("cleared the halt of an earlier run: resuming")
        hold(lambda: self.client.delete(keys.MISCONFIG_STREAK))  # a fresh start: only this run's misses count
        # This run's provider, this run's 429s; and no request before the plan clears the run (it
        # lifts the hold the moment it does, or at once if it has already).
        hold(lambda: self.throttle.reset(self.cfg.request.throttle(),
                                         hold=self._plan is not None and not self._plan.cleared()))
        if self._plan is not None:
            self._plan.on_clear(self._plan_cleared)
        current = json.dumps({"config_id": self.config_id, "datasets": [d.name for d in self.cfg.datasets],
                              "started_s": time.time(), "out_dir": str(self.out_dir)})
        hold(lambda: self.client.set(keys.CURRENT_RUN, current))
        self.collector.start()
        fenced = False
        CLOCK.observe(self._outage_notice)
        spent = hold(lambda: open_run(self.client, self.cfg.run.budget_usd, [d.name for d in self.cfg.datasets]))
        if self.cfg.run.budget_usd:
            log.info("run budget $%.2f, $%.4f spent so far", self.cfg.run.budget_usd, spent)
        try:
            self._warn_if_no_workers()
            for ds in self.cfg.datasets:
                self._run_dataset(ds)
            self._settle_plan(block=True)  # every dataset ended already (resumed, all done): still print it
            while any(r.finished_s is None for r in self._runs):
                self._tick()
                time.sleep(TICK_S)
        except Halted:
            # Workers stop pulling messages that could only end "halted"; the next run re-enqueues.
            self.lock.write(*[("HDEL", keys.ACTIVE_QUEUES, r.budget.keys.queue) for r in self._runs])
            raise
        except ProducerFenced:
            fenced = True
            raise
        finally:
            CLOCK.unobserve(self._outage_notice)
            try:
                # A fenced producer writes nothing more, not even the rows its collector holds.
                self.collector.stop(drain=not fenced)
            finally:
                if self.progress is not None:
                    self.progress.close()
                self.lock.release()
        return [r.summary for r in self._runs if r.summary is not None]

    def _plan_cleared(self) -> None:
        """The plan's thread, the moment requests may start."""
        self.throttle.unhold()
        if self._plan is not None and self._plan.cleared_early:
            log.info("requests start %.2f s after the start, before the plan's counts: %s",
                     time.monotonic() - self._started_s, self._plan.cleared_early)

    def _settle_plan(self, *, block: bool = False) -> None:
        """Once the plan's counts are in: print it, and either let requests start (its thread lifted
        the throttle's hold already; again here in case Redis failed that call) or, refused, end
        every dataset's admission (queued prompts go, those workers hold end without a request; when
        the byte bound let requests start early, those sent finish) and raise."""
        if self._plan is None or self._plan_passed or not (block or self._plan.done()):
            return
        try:
            self._plan.settle()
        except BaseException:
            for r in self._runs:
                if not r.end_reason:
                    self._end_admission(r, "refused")
            raise
        self.hold(self.throttle.unhold)
        self._plan_passed = True
        log.info("plan passed %.2f s after the start: %s", time.monotonic() - self._started_s,
                 "requests had started already" if self._plan.cleared_early else "requests start")

    def _start_deferred_counts(self, states: dict[str, DatasetState]) -> None:
        """Counts the byte bound made optional (``PendingPlan``) start once the first wave has left:
        requests in flight stopped growing between two samples, or every queued prompt was taken."""
        in_flight = sum(st.in_flight for st in states.values())
        previous, self._last_in_flight = self._last_in_flight, in_flight
        if self._plan is None or not self._plan.awaiting_start():
            return
        taken = bool(self._runs) and all(r.enqueue_done for r in self._runs) and not any(
            st.queued for st in states.values())
        if (in_flight and in_flight <= previous) or taken:
            log.info("the first wave has left %.2f s after the start (%s in flight): the plan's counts start",
                     time.monotonic() - self._started_s, f"{in_flight:,}")
            self._plan.start_counts()

    def _outage_notice(self, elapsed_s: float) -> None:
        """Called by every failed Redis attempt of any thread while Redis is away: shown every few s."""
        outage = (CLOCK.outages, CLOCK.down_since)
        if outage == self._outage_shown and elapsed_s - self._outage_shown_s < OUTAGE_NOTICE_EVERY_S:
            return
        self._outage_shown, self._outage_shown_s = outage, elapsed_s
        self._show(f"Redis unreachable, retrying ({elapsed_s:.0f} s)")

    def _show(self, text: str) -> None:
        """A state line (Redis away, Redis refusing writes): on the progress view, or logged."""
        if self.progress is not None and hasattr(self.progress, "notice"):
            self.progress.notice(text)
        else:
            log.warning("%s", text)

    def _check_collector(self) -> None:
        error = self.collector.error
        if isinstance(error, RedisOutage | ProducerFenced | RedisRefusesWrites):
            raise error
        if error is not None:
            raise SpecfleetError(f"collector failed: {error}")

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: Any) -> None:
            log.warning("%s: stopping; run the same config again to resume", signal.Signals(signum).name)
            self._interrupted.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _warn_if_no_workers(self) -> None:
        # A broadcast ping waits its whole timeout for replies: in a thread, so the first prompt is
        # queued at once instead of a second later.
        threading.Thread(target=self._ping_workers, name="ping", daemon=True).start()

    def _ping_workers(self) -> None:
        try:
            # A connection of its own: on the pooled one the run's enqueue also uses, the wait for
            # replies lasted until the run ended (seen in `specfleet demo`: the warning came last).
            with self.app.connection_for_write() as conn:
                replies = self.app.control.ping(timeout=1.0, connection=conn)
        except Exception:  # control needs the broker only; a failure here is not fatal
            replies = []
        if not replies:
            log.warning("no worker answered a ping: start some with `specfleet worker` (same REDIS_URL)")
        else:
            log.info("%d worker(s) online", len(replies))

    # --- one dataset -----------------------------------------------------------------------

    def _run_dataset(self, ds: DatasetConfig) -> None:
        budget = Budget(self.client, ds.name)
        run = DatasetRun(cfg=ds, budget=budget)
        self._runs.append(run)
        sink = self.collector.add(ds.name)
        k = budget.keys
        if budget.snapshot().run_exhausted:
            # The run's dollars are spent: this dataset gets no request (finalized on the next tick).
            run.end_reason, run.enqueue_done = "run_budget", True
            run.admission_ended_s = run.first_stop_s = time.time()
            log.warning("%s: skipped, the run's dollar budget is spent", ds.name)
            return
        self.lock.refresh()  # the budget's calls are not fenced in their script: checked just before
        self._restore_from_disk(budget, sink.writer, ds.regenerate)
        # Failures of an earlier run get another chance; the queue is rebuilt from the file below.
        self.lock.write(("DEL", k.failed, k.queue))
        kept, rows = self.hold(lambda: budget.open(ds.budget_tokens, ds.budget_usd, self.cfg.run.budget_mode))
        run.resumed_rows = rows
        log.info(
            "%s: start (%s, %s budget %s tokens%s%s)", ds.name, ds.length, self.cfg.run.budget_mode,
            f"{ds.budget_tokens:,}", f", ${ds.budget_usd:,.2f}" if ds.budget_usd else "",
            f", resuming with {kept:,} tokens in {rows:,} rows" if rows else "",
        )
        self._follow(k.queue)
        previous = self._runs[-2] if len(self._runs) > 1 else None
        errors: list[DatasetRowError] = []
        stats = ReadStats()
        prompts = read_prompts(ds.path, errors, stats, limit=ds.max_prompts, max_line_bytes=ds.max_line_bytes)
        first_batch = True
        enqueue_started = time.monotonic()
        for batch in _batches(prompts, ENQUEUE_BATCH):
            if self._admission_over(run):
                break
            run.enqueued += self._enqueue(run, batch)
            if first_batch and previous is not None and previous.admission_ended_s is not None:
                previous.switch_s = time.time() - previous.admission_ended_s
                first_batch = False
            self._tick()
        run.enqueue_s = time.monotonic() - enqueue_started
        for _ in prompts:  # count the rest of the file for the report, nothing more
            pass
        run.prompts, run.malformed = stats.prompts, stats.malformed + stats.duplicates
        DatasetStats(self.client, ds.name).record_prompts(run.prompts)  # the exporter's skipped needs it
        run.enqueue_done = True
        self._write_malformed(run, errors)
        log.info("%s: %s prompts queued in %.2f s (%s malformed rows)", ds.name, f"{run.enqueued:,}",
                 run.enqueue_s, f"{run.malformed:,}")
        while not run.end_reason:
            self._tick()
            time.sleep(TICK_S)

    def _restore_from_disk(self, budget: Budget, writer: RowWriter, regenerate: str) -> None:
        """The shards are the truth of what is kept: make the exactly-once guard and the counters
        agree with them (plus the rows waiting in the results stream) before anything is asked.
        Redis lost kept rows the shards hold (a server without persistence restarted): rebuilt from
        the shards. Redis counts rows the shards lack (written over by a producer that had lost its
        lock, or a folder emptied by hand): those prompts are asked again."""
        if self.hold(lambda: budget.agrees_with(writer.last_id, writer.rows)):
            return
        rows_in_redis = budget.snapshot().rows
        ids: list[str] = []
        tokens: list[int] = []
        costs: list[float] = []
        turns: dict[str, bytes] = {}
        ended: list[str] = []
        for row in writer.iter_kept():
            ids.append(row.get("key") or row["id"])  # a regenerated turn's key is "<id>#<turn>"
            tokens.append(int(row["num_tokens"]))
            costs.append(float((row.get("usage") or {}).get("cost") or 0.0))
            if regenerate == "all" and "key" in row:
                # The turn as the worker stored it with its settle: the last message of its row.
                end = row.get("conversation_end") or ""
                turns[row["key"]] = msgpack.packb({"message": row["conversations"][-1], "end": end},
                                                  use_bin_type=True)
                if end:
                    ended.append(row["id"])
        changed = self.hold(lambda: budget.reconcile(writer.last_id, ids, tokens, costs))
        if changed is None:
            return
        rows, lost = changed
        if lost:
            log.warning("%s: Redis counted %s kept rows the shards do not hold and the results stream does not "
                        "hold either: those prompts are asked again (the shards hold %s rows)", budget.keys.dataset,
                        f"{lost:,}", f"{writer.rows:,}")
        if rows_in_redis < rows:
            log.warning("%s: Redis knew %d kept rows, the shards and the stream hold %d: restoring from the shards "
                        "(dollars from the rows' usage.cost: billed answers that were not kept are not on disk)",
                        budget.keys.dataset, rows_in_redis, rows)
        if turns:
            self.hold(lambda: restore_turns(self.client, budget.keys, turns, ended))

    def _enqueue(self, run: DatasetRun, batch: list[Prompt]) -> int:
        done = self.client.smismember(_outcome_key(run), [p.id for p in batch])
        payloads: list[TaskPayload] = [
            {
                "v": CONTRACT_VERSION,
                "run": self.config_id,
                "dataset": run.name,
                "id": p.id,
                "where": p.where,
                "messages": p.messages,
                "tools": p.tools,
            }
            for p, is_done in zip(batch, done, strict=True)
            if not is_done
        ]
        return push(self.client, self.app, run.budget.keys.queue, payloads, fence=self.lock)

    def _admission_over(self, run: DatasetRun) -> bool:
        if self._interrupted.is_set():
            raise Interrupted("interrupted")
        self._settle_plan()
        self._check_collector()
        return bool(run.end_reason)

    # --- watching ---------------------------------------------------------------------------

    def _tick(self) -> None:
        if self._interrupted.is_set():
            raise Interrupted("interrupted")
        self._settle_plan()
        # After a pause (SIGSTOP, a VM or a long GC) the lock must be proved ours before anything
        # else: the writes below that are not fenced in their own script rely on it.
        self.lock.refresh_if_older(LOCK_CHECK_EVERY_S)
        halt = self.client.get(keys.HALT)
        if halt is not None:
            info = json.loads(halt)
            raise Halted(halt_line(info["reason"], info["message"]))
        self._check_collector()
        now = time.time()
        if CLOCK.outages != self._outages_seen:
            # Redis was away: make sure the lock is still ours before anything else is written.
            self._outages_seen = CLOCK.outages
            self.lock.refresh()
        if now - self._last_reap_s >= REAP_EVERY_S:
            self._last_reap_s = now
            self.lock.refresh()
            for r in self._runs:
                if r.finished_s is None and (n := self.hold(r.budget.reap)):
                    log.warning("%s: reclaimed %d expired lease(s) of dead workers", r.name, n)
        states = {r.name: read_state(self.client, r.name) for r in self._runs if r.finished_s is None}
        for r in self._runs:
            st = states.get(r.name)
            if st is None:
                continue
            if not r.end_reason:
                self._check_admission(r, st, now)
            elif r.finished_s is None:
                self._check_drained(r, st, now)
        if now - self._last_sample_s >= SAMPLE_EVERY_S:
            self._last_sample_s = now
            if states:
                self.lock.write(*[("RPUSH", keys.DatasetKeys(name).timeline, json.dumps(st.to_json()))
                                  for name, st in states.items()])
            self._start_deferred_counts(states)
            if self.progress is not None and self._plan_passed:  # the plan's table first
                shown = [states.get(r.name) or r.final_state for r in self._runs]
                self.progress.update([st for st in shown if st is not None], self.throttle.snapshot())

    def _check_admission(self, run: DatasetRun, st: DatasetState, now: float) -> None:
        if st.state == "exhausted":
            self._end_admission(run, BUDGET_END_REASONS.get(st.ended_by, "budget"))
            return
        if not run.enqueue_done:
            return
        outcomes = int(self.client.scard(_outcome_key(run))) + st.failed
        if outcomes >= run.prompts:
            self._end_admission(run, "complete")
            return
        if st.queued or st.in_flight:
            run.idle_since_s = None
            return
        if run.idle_since_s is None:
            run.idle_since_s = now
        if now - run.idle_since_s < self.tuning.stall_s:
            return
        run.idle_since_s = None
        if run.sweeps >= self.tuning.max_sweeps:
            log.error("%s: %d prompts never got an outcome after %d sweeps", run.name, run.prompts - outcomes,
                      run.sweeps)
            self._end_admission(run, "stalled")
            return
        run.sweeps += 1
        requeued = self._sweep(run)
        log.warning("%s: queue idle with %d prompts lacking an outcome; re-enqueued %d (sweep %d)",
                    run.name, run.prompts - outcomes, requeued, run.sweeps)

    def _sweep(self, run: DatasetRun) -> int:
        """Re-enqueue prompts with no outcome (a message lost with a Redis that did not persist)."""
        # A conversation's failure is its failed turn's (row key "<id>#<turn>").
        failed = set(k.decode() if run.cfg.regenerate == "last" else conversation_of(k.decode())
                     for k in self.client.hkeys(run.budget.keys.failed))
        errors: list[DatasetRowError] = []
        n = 0
        for batch in _batches(read_prompts(run.cfg.path, errors, ReadStats(), limit=run.cfg.max_prompts,
                                             max_line_bytes=run.cfg.max_line_bytes),
                              ENQUEUE_BATCH):
            todo = [p for p in batch if p.id not in failed]
            if n < 10 and todo:  # which ones, so a lost message can be traced
                done = self.client.smismember(_outcome_key(run), [p.id for p in todo])
                missing = [p.id for p, d in zip(todo, done, strict=True) if not d]
                if missing:  # a batch of prompts that all have their outcome says nothing
                    log.info("%s: sweeping %s", run.name, ", ".join(missing))
            n += self._enqueue(run, todo)
        return n

    def _follow(self, queue: str) -> None:
        """Make ``queue`` active; workers hear it at once (a broadcast), or at their next poll."""
        self.lock.write(("HSET", keys.ACTIVE_QUEUES, queue, self.config_id))
        try:
            self.app.control.broadcast(FOLLOW_COMMAND)
        except Exception as exc:
            log.debug("%s broadcast failed (workers follow on their next poll): %s", FOLLOW_COMMAND, exc)

    def _end_admission(self, run: DatasetRun, reason: str) -> None:
        run.end_reason = reason
        run.admission_ended_s = time.time()
        if run.first_stop_s is None:
            run.first_stop_s = run.admission_ended_s
            run.rows_at_first_stop = run.budget.snapshot().rows
        k = run.budget.keys
        # Order matters: workers stop following the queue, then what is left in it goes. Messages a
        # worker already reserved find the dataset not active and end without a request.
        self.lock.write(("HDEL", keys.ACTIVE_QUEUES, k.queue))
        if reason not in BUDGET_END_REASONS.values():
            self.lock.refresh()
            self.hold(run.budget.close)
        purged = int(self.lock.write(("LLEN", k.queue), ("DEL", k.queue))[0])
        try:
            self.app.control.cancel_consumer(k.queue)
        except Exception as exc:  # workers also drop it on their next poll
            log.debug("cancel_consumer broadcast failed: %s", exc)
        log.info("%s: admission ended (%s), %s queued prompts removed", run.name, reason, f"{purged:,}")

    def _check_drained(self, run: DatasetRun, st: DatasetState, now: float) -> None:
        assert run.admission_ended_s is not None
        drained = st.in_flight == 0 and self.collector.pending(run.name) == 0
        timed_out = now - run.admission_ended_s > self.tuning.drain_timeout_s
        if not (drained or timed_out):
            return
        if timed_out and not drained:
            log.error("%s: %d requests still in flight after the drain timeout", run.name, st.in_flight)
        elif self._top_up(run, st):
            return
        self.lock.refresh()  # what follows (the budget's close, the summary) is this producer's to write
        self.hold(run.budget.close)
        run.finished_s = now
        final = run.final_state = read_state(self.client, run.name)
        self.lock.write(("RPUSH", run.budget.keys.timeline, json.dumps(final.to_json())))  # the plot ends where it did
        self._finalize(run, final)
        if self.progress is not None and hasattr(self.progress, "finish"):
            # The last frame shows how it ended, and the fleet's throttle as it is then.
            self.progress.finish(final, run.end_reason, self.throttle.snapshot())

    def _top_up(self, run: DatasetRun, st: DatasetState) -> bool:
        """Give the room a budget stop left another round, while the next dataset runs.

        Projected rule only (BudgetPolicy.should_top_up): its stop projects in-flight requests with
        the length-biased mean and can end a few percent short once they land; a round admits only
        what the room can take, so each one leaves a fraction of the previous shortfall. The hard
        rule stops only when less than one worst case is left, which no round could use.
        """
        if run.end_reason != "budget" or run.top_ups >= self.tuning.max_top_ups:
            return False
        length = self.cfg.length_for(run.cfg.length)
        prior = run.budget.policy.prior_tokens(length.max_tokens, length.estimate_tokens)
        if not run.budget.policy.should_top_up(run.budget.snapshot(), prior):
            return False
        room = st.limit - st.kept_tokens
        self.lock.refresh()
        self.hold(lambda: run.budget.open(run.cfg.budget_tokens, run.cfg.budget_usd, self.cfg.run.budget_mode))
        self._follow(run.budget.keys.queue)
        queued = self._sweep(run)
        if not queued:
            self.lock.write(("HDEL", keys.ACTIVE_QUEUES, run.budget.keys.queue))
            return False
        run.top_ups += 1
        run.end_reason = ""
        log.info("%s: %s tokens of budget left once in-flight work landed: top-up round %d",
                 run.name, f"{room:,}", run.top_ups)
        return True

    # --- the dataset's files ----------------------------------------------------------------

    def _dataset_dir(self, run: DatasetRun) -> Path:
        path = self.out_dir / run.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _write_malformed(self, run: DatasetRun, errors: list[DatasetRowError]) -> None:
        for err in errors[:20]:
            log.warning("%s", err)
        if len(errors) > 20:
            log.warning("%s: … and %d more malformed rows (see malformed.jsonl)", run.name, len(errors) - 20)
        lines = [json.dumps({"where": e.where, "reason": e.reason}, ensure_ascii=False) for e in errors]
        atomic_write(self._dataset_dir(run) / "malformed.jsonl", "".join(x + "\n" for x in lines))

    def _finalize(self, run: DatasetRun, st: DatasetState) -> None:
        failures = run.budget.failures()
        lines = [json.dumps({"id": pid, **f}, ensure_ascii=False) for pid, f in sorted(failures.items())]
        atomic_write(self._dataset_dir(run) / "failed.jsonl", "".join(x + "\n" for x in lines))
        wall_s = (run.finished_s or time.time()) - run.started_s
        results = st.rows
        summary = Summary(
            dataset=run.name,
            end_reason=run.end_reason,
            prompts=run.prompts,
            results=results,
            results_this_run=results - run.resumed_rows,
            failed=len(failures),
            skipped=max(0, run.prompts - results - len(failures)),
            malformed=run.malformed,
            tokens=st.kept_tokens,
            budget_tokens=st.limit,
            **summary_counts(st),
            budget_mode=st.budget_mode,
            budget_usd=run.cfg.budget_usd,
            spent_usd=round(st.spent_usd, 9),
            unresolved_usd=round(st.orphaned_usd, 9),
            run_budget_usd=self.cfg.run.budget_usd,
            run_spent_usd=round(st.run_spent_usd, 9),
            dead_letters=st.dead_letters,
            errors=st.errors,
            failures=st.failures,
            throttle=throttle_summary(self.throttle.snapshot()),
            wall_s=round(wall_s, 3),
            admission_s=round((run.first_stop_s or time.time()) - run.started_s, 3),
            switch_s=None if run.switch_s is None else round(run.switch_s, 3),
            top_ups=run.top_ups,
            rows_at_first_stop=run.rows_at_first_stop,
            enqueue_s=None if run.enqueue_s is None else round(run.enqueue_s, 3),
            shards=self.collector.add(run.name).writer.files(),
        )
        if run.cfg.regenerate == "all":
            ended, per_conversation = conversation_counts(self.client, run.budget.keys)
            summary.regenerate = "all"
            summary.conversations_ended = ended
            summary.conversations_partial = max(0, len(per_conversation) - ended - len(failures))
            summary.skipped = max(0, run.prompts - ended - len(failures))
            summary.turns_per_conversation = {str(n): c for n, c in sorted(Counter(per_conversation.values()).items())}
        run.summary = summary
        atomic_write(self._dataset_dir(run) / "summary.json", summary.dumps())
        log.info("%s", report_line(summary))


def retry_window_s(client: redis.Redis) -> float:
    """The client's retry window (``SPECFLEET_REDIS_RETRY_WINDOW_S``): how long any wait for Redis lasts."""
    return float(getattr(client.get_retry(), "window_s", 300.0))


def where(client: redis.Redis) -> str:
    """``host:port/db`` of the client's server, for the lines that name it."""
    kw = client.connection_pool.connection_kwargs
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def _outcome_key(run: DatasetRun) -> str:
    """The set of ids with an outcome other than a failure: kept prompts, or ended conversations."""
    k = run.budget.keys
    return k.ended if run.cfg.regenerate == "all" else k.done


def restore_turns(client: redis.Redis, k: keys.DatasetKeys, turns: dict[str, bytes], ended: list[str]) -> None:
    """The conversations' kept turns and ends, rebuilt from the shards with the done set."""
    pipe = client.pipeline(transaction=False)
    items = list(turns.items())
    for i in range(0, len(items), 1000):
        pipe.hset(k.turns, mapping=dict(items[i:i + 1000]))
    for i in range(0, len(ended), 1000):
        pipe.sadd(k.ended, *ended[i:i + 1000])
    pipe.execute()


def conversation_counts(client: redis.Redis, k: keys.DatasetKeys) -> tuple[int, Counter[str]]:
    """Ended conversations, and kept turns per conversation (from the turns' keys alone)."""
    per_conversation: Counter[str] = Counter()
    for key in client.hkeys(k.turns):
        per_conversation[conversation_of(key.decode())] += 1
    return int(client.scard(k.ended)), per_conversation


def _batches(items: Iterator[Prompt], size: int) -> Iterator[list[Prompt]]:
    batch: list[Prompt] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
