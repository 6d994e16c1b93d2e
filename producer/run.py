"""A run: the config's datasets in order, each enqueued, watched and stopped on its budget.

A dataset ends its admission when the budget script marks it exhausted (the next request would not
fit), or when every prompt has an outcome. Then its queue leaves ``specfleet:active`` and is purged,
and the next dataset starts at once; the ended one drains in the background (admitted requests are
paid for, so they land) and is finalized — summary.json, failed.jsonl — when nothing is in flight.

The runner is the loop: the lock, signals and Redis' outages here, and one handler per phase of a
dataset that the state machine (``producer/dataset_run.py``) calls on each tick: the handler of the
phase being left names the move, the machine makes it. Admission (its start, enqueue, sweeps, its end, top-ups) in
``producer/admission.py``; the plan's hold on requests in ``producer/plan_gate.py``; the shards'
truth restored in ``producer/restore.py``; the dataset's files in ``producer/finalize.py``; the
workers' ping in ``producer/ping.py``.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from celery import Celery

from common import keys, tokenizer_pin
from common.batches import open_batches
from common.budget import Budget, open_run
from common.config import DatasetConfig, RunConfig
from common.contract import halt_line
from common.datasets import dataset_problem
from common.errors import (
    ConfigError,
    Halted,
    Interrupted,
    ProducerFenced,
    RedisRefusesWrites,
    SpecfleetError,
)
from common.manifest import Manifest, manifest_for, read_manifests, write_manifest
from common.redis_client import CLOCK, RedisOutage
from common.settings import Settings
from common.stats import DatasetStats
from common.throttle import FleetThrottle
from producer import redis_memory
from producer.admission import ENQUEUE_BATCH, AdmissionControl
from producer.collector import Collector
from producer.dataset_run import DatasetPhase, DatasetRun, EndReason, Lifecycle, Look, Move, Tuning
from producer.finalize import dataset_dir, finalize, write_excluded, write_malformed
from producer.lock import ProducerLock
from producer.ping import warn_if_no_workers
from producer.plan import PendingPlan
from producer.plan_gate import PlanGate
from producer.provenance import finish_manifest
from producer.providers import require_pin
from producer.refusals import WriteHold
from producer.rows import disk_generation, output_error, place_of
from producer.share import write_shared
from producer.state import DatasetState, read_state
from producer.summary import Summary, throttle_summary
from producer.window import PromptStream

log = logging.getLogger(__name__)

TICK_S = 0.25
SAMPLE_EVERY_S = 1.0
REAP_EVERY_S = 5.0
#: The tick proves the lock ours first when it was last proved longer ago than this (a pause).
LOCK_CHECK_EVERY_S = 1.0
#: How often "Redis unreachable, retrying (n s)" is shown while Redis is away.
OUTAGE_NOTICE_EVERY_S = 5.0

__all__ = ["ENQUEUE_BATCH", "DatasetRun", "Runner", "Tuning"]


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
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``plan``: the plan still counting (``producer/plan.py``): prompts are queued and workers
        prepare them meanwhile, and no request starts until it passes. ``sleep``: the wait between
        two ticks (a test observes when the runner waits)."""
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
        self.collector = Collector(client, self.out_dir, cfg.output.shard_rows, fence=self.lock,
                                   truncated=cfg.request.truncated, degenerate=cfg.request.degenerate)
        self.throttle = FleetThrottle(client)
        self.gate = PlanGate(plan, self.throttle, self.hold)
        self.admission = AdmissionControl(cfg, client, app, self.lock, self.hold, self.tuning)
        self._batched = cfg.batch_view() is not None
        self._sleep = sleep
        P = DatasetPhase
        self.machine = Lifecycle({P.QUEUED: self._queued, P.PLANNING: self._planning,
                                  P.ADMITTING: self.admission.check, P.TOPPING_UP: self.admission.check,
                                  P.DRAINING: self._draining})
        self._runs: list[DatasetRun] = []
        #: The run manifest (``common/manifest.py``), built when the run starts.
        self.manifest: Manifest | None = None
        self._last_sample_s = 0.0
        self._last_reap_s = 0.0
        self._outages_seen = 0
        self._outage_shown: tuple[int, float | None] = (-1, None)
        self._outage_shown_s = 0.0

    @property
    def interrupted(self) -> bool:
        """SIGTERM/SIGINT arrived: the run is stopping."""
        return self._interrupted.is_set()

    def wait_interrupted(self) -> None:
        """Until SIGTERM/SIGINT arrives."""
        self._interrupted.wait()

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> list[Summary]:
        missing = [f"datasets[{i}] ({d.name}).path: {why}"
                   for i, d in enumerate(self.cfg.datasets) if (why := dataset_problem(d.path))]
        if missing:  # before anything is enqueued: a typo in the third dataset must not wait hours
            raise ConfigError("dataset files missing\n  " + "\n  ".join(missing))
        self.cfg.require_prices()
        self.cfg.require_batch_variant()
        require_pin(self.cfg)
        # Above the generation that wrote any of the folders: a Redis that lost its counter
        # must not hand out a generation the folders would take for an old producer's.
        self.lock.acquire(max((disk_generation(self.out_dir / d.name) for d in self.cfg.datasets), default=0))
        self._install_signal_handlers()
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise output_error(self.out_dir, exc) from None
        hold = self.hold
        # Before the first task: every row a worker keeps names this manifest.
        self.manifest = manifest_for(self.cfg)
        try:
            write_manifest(self.out_dir, self.manifest)
            self.admission.manifests = frozenset(read_manifests(self.out_dir))
            self.collector.accept_manifests(self.admission.manifests)
        except OSError as exc:
            raise output_error(self.out_dir, exc) from None
        # The files themselves too, so a worker on any host loads the manifest's (common/tokenizer_pin.py).
        manifest = self.manifest
        pin = hold(lambda: tokenizer_pin.publish(self.client, manifest))
        view = self.cfg.worker_view(manifest=manifest.manifest_id, tokenizer_pin=pin).model_dump_json()
        hold(lambda: self.client.set(keys.config(self.config_id), view))
        if hold(lambda: self.client.delete(keys.HALT)):
            log.warning("cleared the halt of an earlier run: resuming")
        hold(lambda: self.client.delete(keys.MISCONFIG_STREAK))  # a fresh start: only this run's misses count
        # This run's provider, this run's 429s; and no request before the plan clears the run (it
        # lifts the hold the moment it does, or at once if it has already).
        hold(lambda: self.throttle.reset(self.cfg.request.throttle(), hold=self.gate.holds_requests()))
        self.gate.arm()
        current = json.dumps({"config_id": self.config_id, "datasets": [d.name for d in self.cfg.datasets],
                              "started_s": time.time(), "out_dir": str(self.out_dir)})
        hold(lambda: self.client.set(keys.CURRENT_RUN, current))
        self.collector.start()
        threading.Thread(target=self._check_redis_memory, name="redis-memory", daemon=True).start()
        fenced = False
        CLOCK.observe(self._outage_notice)
        spent = hold(lambda: open_run(self.client, self.cfg.run.budget_usd, [d.name for d in self.cfg.datasets]))
        if self.cfg.run.budget_usd:
            log.info("run budget $%.2f, $%.4f spent so far", self.cfg.run.budget_usd, spent)
        try:
            warn_if_no_workers(self.app)
            for ds in self.cfg.datasets:
                self._run_dataset(ds)
            self._settle_plan(block=True)  # every dataset ended already (resumed, all done): still print it
            while not all(r.ended for r in self._runs):
                self._tick()
                self._sleep(TICK_S)
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
        summaries = [r.summary for r in self._runs if r.summary is not None]
        if self.manifest is not None:
            try:
                write_manifest(self.out_dir, finish_manifest(self.manifest, summaries))
            except OSError as exc:
                raise output_error(self.out_dir, exc) from None
        return summaries

    def _check_redis_memory(self) -> None:
        """The run's Redis memory estimated from its files' bytes, against maxmemory (a warning when under)."""
        try:
            too_small, line = redis_memory.check(self.client, self.cfg, self.tuning.window)
        except Exception as exc:  # an estimate: never worth stopping the run for
            log.debug("Redis memory estimate failed: %s", exc)
            return
        (log.warning if too_small else log.info)("%s", line)

    def _settle_plan(self, *, block: bool = False) -> None:
        """The plan gate's verdict once the counts are in; refused, every dataset's admission ends
        (queued prompts go, those workers hold end without a request; when the byte bound let
        requests start early, those sent finish) and the refusal propagates."""
        try:
            self.gate.settle(block=block)
        except BaseException:
            refused = Look(time.time(), refused=True)
            for r in self._runs:
                if r.admitting:
                    self.machine.step(r, refused)
            raise

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

    # --- one dataset -----------------------------------------------------------------------

    def _run_dataset(self, ds: DatasetConfig) -> None:
        run = DatasetRun(cfg=ds, budget=Budget(self.client, ds.name))
        previous = self._runs[-1] if self._runs else None
        self._runs.append(run)
        self.collector.add(ds.name)
        self.machine.step(run, Look(time.time()))
        if not run.admitting:
            return  # skipped: the run's dollars are spent
        if previous is not None and previous.admission_ended_s is not None and previous.switch_s is None:
            previous.switch_s = time.time() - previous.admission_ended_s
        # The window is refilled on each tick (``_feed``), until the file's end or admission's, or
        # (batch mode) until only its submitted batches and its live tail are out: they settle while
        # the next one runs.
        while run.admitting and not self._only_tail_left(run):
            self._tick()
            if run.admitting:  # ended in this tick: the next dataset starts now, not a tick later (the switch)
                self._sleep(TICK_S)

    def _only_tail_left(self, run: DatasetRun) -> bool:
        """A batch-mode dataset lets the next one start once it has nothing left but its submitted
        batches, once its room is all held by the batches out (it admits nothing before they land),
        or once (``tail = "live"``) only its last round and the few live requests of its tail are
        left; it stays admitting, checked and fed on each tick, its results settling into its own
        rows and budget."""
        if not self.admission.batched(run):
            return False
        st = read_state(self.client, run.name)
        if self.admission.only_batches_out(run, st):
            log.info("%s: every prompt left waits in a submitted batch: the next dataset starts", run.name)
            return True
        if self.admission.room_held(run, st):
            log.info("%s: its room is held by the batches out (%s tokens), it admits nothing before they land: "
                     "the next dataset starts", run.name, f"{st.reserved_tokens:,}")
            return True
        if self.admission.in_live_tail(run, st):
            log.info("%s: %s tokens of room, its last round out and the rest live: the next dataset starts",
                     run.name, f"{st.limit - st.kept_tokens:,}")
            return True
        return False

    def _feed(self) -> None:
        """Each admitting dataset's queue refilled to its window; a first read stopped by admission's
        end counted to the file's end, and one at the file's end taken into the dataset's counts."""
        for r in self._runs:
            if r.admitting:
                self.admission.fill(r)
            else:
                # Admission ended before the file's end: the rest counted for the report, in a thread
                # started here, after the next dataset's first prompts are queued (it takes the GIL).
                r.feed.count_rest()
            if (read := r.feed.counts_due()) is not None:
                self._counted(r, read)

    def _counted(self, run: DatasetRun, read: PromptStream) -> None:
        """The dataset's file was read to its end: its counts for the report, the exporter and the
        "every prompt has an outcome" check."""
        stats = read.stats
        run.prompts, run.malformed = stats.prompts, stats.malformed + stats.duplicates
        run.duplicate_prompts, run.excluded = stats.duplicate_prompts, stats.excluded
        run.enqueue_s = time.time() - run.started_s
        # The exporter's skipped needs the prompts; its left-out gauges the rest.
        DatasetStats(self.client, run.name).record_prompts(run.prompts, run.duplicate_prompts, run.excluded)
        run.feed.counted = True
        write_malformed(self.out_dir, run, read.errors)
        write_excluded(self.out_dir, run, read.excluded)
        log.info("%s: %s prompts queued of %s in the file, read in %.2f s (%s malformed rows)", run.name,
                 f"{run.enqueued:,}", f"{run.prompts:,}", run.enqueue_s, f"{run.malformed:,}")

    # --- watching ---------------------------------------------------------------------------

    def _tick(self) -> None:
        """One turn of the loop: the house kept, the queues fed, and each dataset not ended looked at
        by its phase's handler."""
        now = self._keep_house()
        self._feed()
        states = {r.name: read_state(self.client, r.name) for r in self._runs if not r.ended}
        for r in self._runs:
            if (st := states.get(r.name)) is not None:
                self.machine.step(r, Look(now, st))
        if now - self._last_sample_s >= SAMPLE_EVERY_S:
            self._last_sample_s = now
            self._sample(states)

    def _keep_house(self) -> float:
        """Stop when told to or halted, the plan's verdict, the lock proved ours, the collector
        checked, dead workers' leases reclaimed; returns the tick's time."""
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
                if not r.ended and (n := self.hold(r.budget.reap)):
                    log.warning("%s: reclaimed %d expired lease(s) of dead workers", r.name, n)
        return now

    def _sample(self, states: dict[str, DatasetState]) -> None:
        """The timeline's sample of each dataset still running, the plan's view of the fleet, progress."""
        # Not a dataset this tick ended: its final sample (with how it ended) stays the last.
        ended = {r.name for r in self._runs if r.ended}
        sampled = [(name, st) for name, st in states.items() if name not in ended]
        if sampled:
            self.lock.write(*[("RPUSH", keys.DatasetKeys(name).timeline, json.dumps(st.to_json()))
                              for name, st in sampled])
        taken = bool(self._runs) and all(r.feed.counted for r in self._runs) and not any(
            st.queued for st in states.values())
        self.gate.observe(sum(st.in_flight for st in states.values()), taken)
        if self.progress is not None and self.gate.passed:  # the plan's table first
            shown = [states.get(r.name) or r.final_state for r in self._runs]
            self.progress.update([st for st in shown if st is not None], self.throttle.snapshot(),
                                 self._open_batches())

    def _open_batches(self) -> list[dict[str, Any]] | None:
        """The open Batch API batches for the progress view; None (no row) when no dataset is batched."""
        return open_batches(self.client) if self._batched else None

    # --- the phases' handlers (producer/dataset_run.py's Lifecycle calls them) -------------------

    def _queued(self, run: DatasetRun, look: Look) -> Move:
        """A dataset's start: skipped when the run's dollars are spent, else opened with its first
        prompts queued at once (the ticks fill the rest of the window), held while the plan counts."""
        if run.budget.snapshot().run_exhausted:
            # The run's dollars are spent: this dataset gets no request (finalized on the next tick).
            run.feed.counted = True  # nothing is read
            run.admission_ended_s = run.first_stop_s = look.now_s
            log.warning("%s: skipped, the run's dollar budget is spent", run.name)
            return Move(DatasetPhase.DRAINING, EndReason.RUN_BUDGET)
        move = self.admission.open(run, self.collector.add(run.name).writer,
                                   DatasetPhase.ADMITTING if self.gate.cleared() else DatasetPhase.PLANNING)
        self.admission.start_window(run)
        self.admission.fill(run, batches=1)
        return move

    def _planning(self, run: DatasetRun, look: Look) -> Move | None:
        """Requests held for the plan: admitting once it clears the run; watched as admitting meanwhile."""
        if not look.refused and self.gate.cleared():
            return Move(DatasetPhase.ADMITTING)
        return self.admission.check(run, look)

    def _draining(self, run: DatasetRun, look: Look) -> Move | None:
        """Admitted requests landing: once none is left in flight (or the drain timed out), a top-up
        round for the room a budget stop left, or the dataset finalized."""
        st = look.state
        assert run.admission_ended_s is not None and st is not None
        if not run.feed.counted:
            return None  # the rest of its file is still being counted (producer/window.py): the summary needs it
        now = look.now_s
        drained = st.in_flight == 0 and self.collector.pending(run.name) == 0
        timed_out = now - run.admission_ended_s > self.tuning.drain_timeout_s
        if not (drained or timed_out):
            return None
        if timed_out and not drained:
            log.error("%s: %d requests still in flight after the drain timeout", run.name, st.in_flight)
        elif (top_up := self.admission.top_up(run, st)) is not None:
            return top_up
        if self.cfg.run.duplicates == "share" and run.duplicate_prompts:
            if not all(r.ended for r in self._runs[:self._runs.index(run)]):
                return None  # the first copies' rows: every earlier dataset's, all of them kept
            # The first copies' rows a trainer reads: the shards' (a truncated or degenerate row only
            # where they keep it).
            policies = (self.cfg.request.truncated, self.cfg.request.degenerate)

            def rows(name: str) -> Iterator[dict[str, Any]]:
                return (r for r in self.collector.add(name).writer.iter_kept() if place_of(r, *policies) is None)

            run.shared = write_shared(dataset_dir(self.out_dir, run), self.admission.prompt_filter, run.cfg, rows)
        self.lock.refresh()  # what follows (the budget's close, the summary) is this producer's to write
        self.hold(run.budget.close)
        run.finished_s = now
        final = run.final_state = read_state(self.client, run.name)
        # The plot ends where it did; the sample names how, for `specfleet status --watch`'s last frame.
        ended = {**final.to_json(), "end_reason": run.end_reason.value if run.end_reason else None}
        self.lock.write(("RPUSH", run.budget.keys.timeline, json.dumps(ended)))
        run.summary = finalize(self.client, self.out_dir, run, final, run_budget_usd=self.cfg.run.budget_usd,
                               throttle=throttle_summary(self.throttle.snapshot()),
                               shards=self.collector.add(run.name).writer.files(),
                               quantizations=self.cfg.model.quantizations, truncated_policy=self.cfg.request.truncated,
                               degenerate_policy=self.cfg.request.degenerate)
        assert run.end_reason is not None
        if self.progress is not None and hasattr(self.progress, "finish"):
            # The last frame shows how it ended, and the fleet's throttle as it is then.
            self.progress.finish(final, run.end_reason.value, self.throttle.snapshot(), self._open_batches())
        return Move(DatasetPhase.ENDED)


def retry_window_s(client: redis.Redis) -> float:
    """The client's retry window (``SPECFLEET_REDIS_RETRY_WINDOW_S``): how long any wait for Redis lasts."""
    return float(getattr(client.get_retry(), "window_s", Settings.redis_retry_window_s))


def where(client: redis.Redis) -> str:
    """``host:port/db`` of the client's server, for the lines that name it."""
    kw = client.connection_pool.connection_kwargs
    return f"{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
