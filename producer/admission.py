"""A dataset's admission, seen from the producer: opened (its shards' truth, its budget), its queue
followed and filled, watched for its end (the budget, every prompt's outcome, a stall after sweeps),
ended, and reopened for a top-up.

The moves out of the admitting phases and into a top-up round are named here (``check``, ``end``,
``top_up`` return them); the runner's handlers hand them to the state machine
(``producer/dataset_run.py``), which makes them.
"""

from __future__ import annotations

import logging
import time

import redis
from celery import Celery

from common import keys
from common.budget import POLICY
from common.config import RunConfig
from common.contract import CONTRACT_VERSION, FOLLOW_COMMAND, TaskPayload, conversation_of
from common.datasets import Prompt
from common.prompt_filter import RunFilter
from common.seal import ensure_key
from producer.dataset_run import BUDGET_END_REASONS, DatasetPhase, DatasetRun, EndReason, Look, Move, Tuning
from producer.enqueue import Pushed, push_batch
from producer.lock import ProducerLock
from producer.refusals import WriteHold
from producer.restore import restore_from_disk
from producer.rows import RowWriter
from producer.state import DatasetState
from producer.window import PromptStream, QueueWindow

log = logging.getLogger(__name__)

ENQUEUE_BATCH = 1000
#: Batches one fill reads at most: a tick stays short while a resumed run skips prompts already done
#: (two per 0.25 s tick: up to 8,000 prompts/s, above any fleet's rate).
FILL_BATCHES = 2
#: The fill proves the lock ours before a batch when it was last proved longer ago than this.
LOCK_CHECK_EVERY_S = 1.0


class AdmissionControl:
    def __init__(self, cfg: RunConfig, client: redis.Redis, app: Celery, lock: ProducerLock, hold: WriteHold,
                 tuning: Tuning) -> None:
        self.cfg = cfg
        self.config_id = cfg.config_id()
        self.client = client
        self.app = app
        self.lock = lock
        self.hold = hold
        self.tuning = tuning
        #: Duplicates and eval leaks, left out of every read of the run (common/prompt_filter.py).
        self.prompt_filter = RunFilter(cfg)
        #: The output folder's manifests (the run's and those of earlier runs of the folder): a row
        #: waiting in Redis under another is another folder's (producer/restore.py). Empty: any.
        self.manifests: frozenset[str] = frozenset()

    def open(self, run: DatasetRun, writer: RowWriter, phase: DatasetPhase) -> Move:
        """Start the dataset: Redis made to agree with its shards, its failures given another
        chance, its budget opened, its queue followed; the move into ``phase``: planning (requests
        held for the plan) or admitting."""
        ds, budget = run.cfg, run.budget
        k = budget.keys
        self.lock.refresh()  # the budget's calls are not fenced in their script: checked just before
        restore_from_disk(self.client, self.hold, budget, writer, ds.regenerate, self.manifests)
        # Failures of an earlier run get another chance; the queue is rebuilt from the file.
        self.lock.write(("DEL", k.failed, k.queue))
        kept, rows = self.hold(lambda: budget.open(ds.budget_tokens, ds.budget_usd, self.cfg.run.budget_mode))
        run.resumed_rows = rows
        log.info(
            "%s: start (%s, %s budget %s tokens%s%s)", ds.name, ds.length, self.cfg.run.budget_mode,
            f"{ds.budget_tokens:,}", f", ${ds.budget_usd:,.2f}" if ds.budget_usd else "",
            f", resuming with {kept:,} tokens in {rows:,} rows" if rows else "",
        )
        self.follow(k.queue)
        return Move(phase)

    def follow(self, queue: str) -> None:
        """Make ``queue`` active; workers hear it at once (a broadcast), or at their next poll."""
        self.lock.write(("HSET", keys.ACTIVE_QUEUES, queue, self.config_id))
        try:
            self.app.control.broadcast(FOLLOW_COMMAND)
        except Exception as exc:
            log.debug("%s broadcast failed (workers follow on their next poll): %s", FOLLOW_COMMAND, exc)

    def start_window(self, run: DatasetRun, *, skip: frozenset[str] = frozenset(), sweep: bool = False) -> QueueWindow:
        """A new read of the dataset's file, queued through the window from its start; the first
        read of a dataset is also its count (``Feed.first``)."""
        key = self.hold(lambda: ensure_key(self.client, run.name))
        stream = PromptStream(run.cfg, self.prompt_filter if self.prompt_filter.active else None)
        window = QueueWindow(stream, self.tuning.window, key, skip, sweep=sweep)
        run.feed.open(window)
        return window

    def fill(self, run: DatasetRun, *, batches: int = FILL_BATCHES) -> int:
        """Refill the dataset's queue up to its window (at most ``batches`` batches read, so a tick
        stays short while a resumed run skips what is done); returns how many were queued."""
        w = run.feed.window
        if w is None or w.stream.exhausted:
            return 0
        queued = int(self.client.llen(run.budget.keys.queue))
        cap = self.admittable(run)
        n = 0
        for _ in range(batches):
            room = w.room(queued + n) if cap is None else min(w.room(queued + n), cap - queued - n)
            if room <= 0:
                break
            # A batch is ~1 s of CPU on a starved box: the lock (10 s) must not lapse between ticks.
            self.lock.refresh_if_older(LOCK_CHECK_EVERY_S)
            batch = w.stream.take(min(ENQUEUE_BATCH, room))
            todo = self._lacking_outcome(run, [p for p in batch if p.id not in w.skip])
            if w.sweep and w.pushed < 10 and todo:  # which ones, so a lost message can be traced
                log.info("%s: sweeping %s", run.name, ", ".join(p.id for p in todo))
            pushed = self._push(run, w, todo)
            w.record(len(batch), pushed.messages, pushed.bytes)
            n += pushed.messages
            if w.stream.exhausted:
                break
        run.enqueued += n
        return n

    def admittable(self, run: DatasetRun) -> int | None:
        """A hard-budget batch-mode dataset's prompts worth having queued: as many as its free room
        (limit less kept, less what is held for what is out) admits at a batch round's hold
        (budget.lua: the worst case, or the round's statistical share); None: no cap.

        Queued beyond that, a prompt only waits in a worker, a greenlet and a message held, until a
        round of batches lands (minutes to hours): the next dataset, started meanwhile
        (``room_held``), would find the fleet's pools full of them. Within one worst case of the end
        the cap is lifted: the worker's reserve that answers "over" is what ends the dataset."""
        if not self.batched(run):
            return None
        snap = run.budget.snapshot()
        worst = self._worst_tokens(run)
        if snap.state != "active" or snap.rule != "hard" or snap.limit <= 0 or snap.limit - snap.kept_tokens < worst:
            return None
        return max(0, (snap.limit - snap.kept_tokens - snap.reserved_tokens) // run.budget.round_hold(worst))

    def room_held(self, run: DatasetRun, st: DatasetState) -> bool:
        """A hard-budget batch-mode dataset whose room is all held by what is out (its submitted or
        gathering batches): it can admit nothing until they land, so the next dataset may start."""
        if not (self.batched(run) and st.state == "active" and st.budget_mode == "hard" and st.limit > 0
                and not st.queued and st.reserved_tokens > 0):
            return False
        worst = self._worst_tokens(run)
        free = st.limit - st.kept_tokens - st.reserved_tokens
        return free < run.budget.round_hold(worst) and worst <= st.limit - st.kept_tokens

    def _worst_tokens(self, run: DatasetRun) -> int:
        return POLICY.worst_tokens(self.cfg.length_for(run.cfg.length).max_tokens)

    def _lacking_outcome(self, run: DatasetRun, batch: list[Prompt]) -> list[Prompt]:
        if not batch:
            return []  # SMISMEMBER wants at least one member
        done = self.client.smismember(run.outcome_key, [p.id for p in batch])
        return [p for p, is_done in zip(batch, done, strict=True) if not is_done]

    def _push(self, run: DatasetRun, w: QueueWindow, prompts: list[Prompt]) -> Pushed:
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
            for p in prompts
        ]
        return push_batch(self.client, self.app, run.budget.keys.queue, payloads, fence=self.lock,
                          seal_key=w.seal_key)

    def check(self, run: DatasetRun, look: Look) -> Move | None:
        """One look at an admitting dataset (planning, admitting or topping up): its admission ends
        when the plan refused the run, or the budget or the outcomes say so; a queue idle with
        prompts lacking an outcome is swept; after the last sweep it gives up."""
        if look.refused:
            return self.end(run, EndReason.REFUSED)
        st = look.state
        assert st is not None, "an admitting dataset is looked at with its state"
        if st.state == "exhausted":
            return self.end(run, BUDGET_END_REASONS.get(st.ended_by, EndReason.BUDGET))
        if self._tail_stops(run, st):
            log.info("%s: %s tokens of budget left, less than a full batch's worst cases (%s): tail = \"stop\"",
                     run.name, f"{st.limit - st.kept_tokens:,}", f"{self.full_batch_tokens(run):,}")
            move = self.end(run, EndReason.BUDGET)
            # The budget says stopped, not only the queue: requests parked on a full budget would
            # otherwise be admitted once the batches out land. Their results still settle.
            self.lock.refresh()
            self.hold(run.budget.close)
            return move
        if not run.feed.counted:
            return None
        outcomes = int(self.client.scard(run.outcome_key)) + st.failed
        if outcomes >= run.prompts:
            return self.end(run, EndReason.COMPLETE)
        stall = run.stall
        if st.queued or st.in_flight or run.feed.queuing:
            stall.busy()
            return None
        if stall.idle_for_s(look.now_s) < self.tuning.stall_s:
            return None
        stall.busy()
        if stall.sweeps >= self.tuning.max_sweeps:
            log.error("%s: %d prompts never got an outcome after %d sweeps", run.name, run.prompts - outcomes,
                      stall.sweeps)
            return self.end(run, EndReason.STALLED)
        stall.sweeps += 1
        requeued = self.sweep(run)
        log.warning("%s: queue idle with %d prompts lacking an outcome; re-enqueued %d (sweep %d)",
                    run.name, run.prompts - outcomes, requeued, stall.sweeps)
        return None

    def batched(self, run: DatasetRun) -> bool:
        return self.cfg.dataset_mode(run.cfg) == "batch"

    def full_batch_tokens(self, run: DatasetRun) -> int:
        """A full batch's worst cases: ``batch_size`` x a request's worst case (workers/pipeline/batch/tail.py)."""
        return self.cfg.request.batch_size * POLICY.worst_tokens(self.cfg.length_for(run.cfg.length).max_tokens)

    def _tail_stops(self, run: DatasetRun, st: DatasetState) -> bool:
        """``tail = "stop"``: a batch-mode dataset's admission ends once its room is less than a full
        batch's worst cases (its submitted batches still land)."""
        return (self.cfg.request.tail == "stop" and self.batched(run) and st.state == "active"
                and st.limit - st.kept_tokens < self.full_batch_tokens(run))

    def in_live_tail(self, run: DatasetRun, st: DatasetState) -> bool:
        """``tail = "live"``: a batch-mode dataset whose room is under a full batch's worst cases has
        its last round out and sends the rest live (workers/pipeline/batch/tail.py): it needs no more of the
        fleet than a few live requests, so the next dataset need not wait for that round to land."""
        return (self.cfg.request.tail == "live" and self.batched(run) and st.state == "active"
                and st.limit > 0 and st.limit - st.kept_tokens < self.full_batch_tokens(run))

    def only_batches_out(self, run: DatasetRun, st: DatasetState) -> bool:
        """A batch-mode dataset has nothing left to admit: its file is queued to the end, its queue is
        empty, and every prompt without an outcome waits in a submitted batch. The next dataset
        starts now (its queue, its batches) while these settle into this one's rows and budget: the
        runner keeps checking it as admitting (a batch that gives prompts back gets them swept)."""
        if not (self.batched(run) and run.feed.counted and not st.queued) or run.feed.queuing:
            return False
        batched = int(self.client.hlen(run.budget.keys.batched))
        outcomes = int(self.client.scard(run.outcome_key)) + st.failed
        return batched > 0 and outcomes + batched >= run.prompts

    def sweep(self, run: DatasetRun) -> int:
        """Re-enqueue prompts with no outcome (a message lost with a Redis that did not persist):
        the file read again through a window of its own; returns how many its first fill queued."""
        # A conversation's failure is its failed turn's (row key "<id>#<turn>").
        failed = frozenset(k.decode() if run.cfg.regenerate == "last" else conversation_of(k.decode())
                           for k in self.client.hkeys(run.budget.keys.failed))
        self.start_window(run, skip=failed, sweep=True)
        return self.fill(run)

    def end(self, run: DatasetRun, reason: EndReason) -> Move:
        """Admission's end: workers stop following the queue and what is queued goes; the move
        into draining for ``reason``."""
        run.admission_ended_s = time.time()
        if run.first_stop_s is None:
            run.first_stop_s = run.admission_ended_s
            run.rows_at_first_stop = run.budget.snapshot().rows
        k = run.budget.keys
        # Order matters: workers stop following the queue, then what is left in it goes. Messages a
        # worker already reserved find the dataset not active and end without a request.
        self.lock.write(("HDEL", keys.ACTIVE_QUEUES, k.queue))
        if not reason.by_budget:
            self.lock.refresh()
            self.hold(run.budget.close)
        purged = int(self.lock.write(("LLEN", k.queue), ("DEL", k.queue))[0])
        run.feed.close()  # the rest of its file is counted on the runner's next tick (Runner._feed)
        try:
            self.app.control.cancel_consumer(k.queue)
        except Exception as exc:  # workers also drop it on their next poll
            log.debug("cancel_consumer broadcast failed: %s", exc)
        log.info("%s: admission ended (%s), %s queued prompts removed", run.name, reason.value, f"{purged:,}")
        return Move(DatasetPhase.DRAINING, reason)

    def top_up(self, run: DatasetRun, st: DatasetState) -> Move | None:
        """Give the room a budget stop left another round, while the next dataset runs.

        Projected rule only (BudgetPolicy.should_top_up): its stop projects in-flight requests with
        the length-biased mean and can end a few percent short once they land; a round admits only
        what the room can take, so each one leaves a fraction of the previous shortfall. The hard
        rule stops only when less than one worst case is left, which no round could use.
        """
        if run.end_reason is not EndReason.BUDGET or run.top_ups >= self.tuning.max_top_ups:
            return None
        length = self.cfg.length_for(run.cfg.length)
        prior = run.budget.policy.prior_tokens(length.max_tokens, length.estimate_tokens)
        if not run.budget.policy.should_top_up(run.budget.snapshot(), prior):
            return None
        room = st.limit - st.kept_tokens
        self.lock.refresh()
        self.hold(lambda: run.budget.open(run.cfg.budget_tokens, run.cfg.budget_usd, self.cfg.run.budget_mode))
        self.follow(run.budget.keys.queue)
        queued = self.sweep(run)
        if not queued and not run.feed.queuing:
            run.feed.close()
            self.lock.write(("HDEL", keys.ACTIVE_QUEUES, run.budget.keys.queue))
            return None
        run.top_ups += 1
        log.info("%s: %s tokens of budget left once in-flight work landed: top-up round %d",
                 run.name, f"{room:,}", run.top_ups)
        return Move(DatasetPhase.TOPPING_UP)
