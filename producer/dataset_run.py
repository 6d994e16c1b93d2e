"""One dataset's run as a state machine: its phases, the moves between them, and its record.

Every phase a dataset goes through and every move between two of them is in ``TRANSITIONS``; a move
the table does not name raises ``IllegalTransition`` (docs/DESIGN.md draws it)::

    queued ──> planning ──> admitting ──> draining(reason) ──> ended(reason)
                                            │   ^
                                            v   │
                                          topping_up

and the shortcuts: queued ──> admitting (the plan had cleared the run already), queued ──> draining
(``run_budget``: the run's dollars were spent), planning ──> draining (``refused``; or ``complete``,
``stalled``, a budget before the plan cleared).

- queued: in the run's list, not started.
- planning: started (prompts queued, workers prepare them), every request held until the plan
  clears the run (``producer/plan_gate.py``).
- admitting: requests flow; the budget, the prompts' outcomes or a stall end it.
- draining: admission ended for ``end_reason``; admitted requests land (they are paid for).
- topping_up: a round that refills the room a budget stop left (projected rule); ends as admitting does.
- ended: finalized (summary.json written); nothing more happens to the dataset in this run.

Who moves it: ``Lifecycle`` (below) is the one place a move is made. Each phase has one handler (the
runner's, ``producer/run.py``); the handler of the phase being left looks at the dataset and names
the move, and the machine makes it. What is not a phase belongs to the object that owns it: how far
the file is queued and counted to ``Feed`` (``producer/window.py``), an idle queue's sweeps to
``Stall``; the rest of ``DatasetRun`` is the record summary.json is written from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from common.budget import Budget
from common.config import DatasetConfig
from common.errors import IllegalTransition
from producer.share import Shared
from producer.state import DatasetState
from producer.summary import Summary
from producer.window import Feed, WindowBounds


class DatasetPhase(StrEnum):
    QUEUED = "queued"
    PLANNING = "planning"
    ADMITTING = "admitting"
    DRAINING = "draining"
    TOPPING_UP = "topping_up"
    ENDED = "ended"


class EndReason(StrEnum):
    """Why admission ended (``Summary.end_reason``, summary.json's ``end_reason``)."""

    #: The budget script exhausted the dataset on a limit: admitted requests land.
    BUDGET = "budget"
    BUDGET_USD = "budget_usd"
    RUN_BUDGET = "run_budget"
    #: Every prompt has an outcome.
    COMPLETE = "complete"
    #: Prompts still without an outcome after every sweep.
    STALLED = "stalled"
    #: The plan refused the run.
    REFUSED = "refused"

    @property
    def by_budget(self) -> bool:
        """A limit ended it: admitted requests may land, where the other reasons stop them."""
        return self in (EndReason.BUDGET, EndReason.BUDGET_USD, EndReason.RUN_BUDGET)


#: End reasons by the limit that exhausted a dataset (``BudgetSnapshot.ended_by``).
BUDGET_END_REASONS = {"tokens": EndReason.BUDGET, "usd": EndReason.BUDGET_USD, "run_usd": EndReason.RUN_BUDGET}

P = DatasetPhase
#: Every legal move. Into draining a move names its end reason; no other move does.
TRANSITIONS: dict[DatasetPhase, frozenset[DatasetPhase]] = {
    # The run's dollars already spent: the dataset ends before anything is queued.
    P.QUEUED: frozenset({P.PLANNING, P.ADMITTING, P.DRAINING}),
    # Refused, or (a resumed run) every prompt already had its outcome while the plan counted.
    P.PLANNING: frozenset({P.ADMITTING, P.DRAINING}),
    P.ADMITTING: frozenset({P.DRAINING}),
    P.DRAINING: frozenset({P.TOPPING_UP, P.ENDED}),
    P.TOPPING_UP: frozenset({P.DRAINING}),
    P.ENDED: frozenset(),
}
#: The phases in which the runner watches admission (the budget, the outcomes, a stall).
ADMITTING_PHASES = frozenset({P.PLANNING, P.ADMITTING, P.TOPPING_UP})


@dataclass
class Tuning:
    """Timings a test may shorten; the defaults suit a real run."""

    #: Queue empty and nothing in flight this long, with prompts lacking an outcome: re-enqueue them.
    stall_s: float = 60.0
    max_sweeps: int = 3
    #: How long an ended dataset may drain its admitted requests before it is finalized anyway.
    drain_timeout_s: float = 4 * 3600.0
    #: Rounds that refill the room a budget stop left (see producer/admission.py's top_up).
    max_top_ups: int = 3
    #: How much of a dataset the producer keeps queued (producer/window.py).
    window: WindowBounds = field(default_factory=WindowBounds)


@dataclass
class Stall:
    """An admitting dataset's queue idle (nothing queued, in flight or left to queue) while prompts
    lack an outcome: since when, and how many sweeps re-enqueued them (producer/admission.py's check)."""

    idle_since_s: float | None = None
    sweeps: int = 0

    def busy(self) -> None:
        self.idle_since_s = None

    def idle_for_s(self, now_s: float) -> float:
        """How long the queue has been idle, its first idle look counted as the start."""
        if self.idle_since_s is None:
            self.idle_since_s = now_s
        return now_s - self.idle_since_s


@dataclass
class DatasetRun:
    cfg: DatasetConfig
    budget: Budget
    phase: DatasetPhase = DatasetPhase.QUEUED
    #: Why admission last ended: set by the move into draining, cleared by a top-up round.
    end_reason: EndReason | None = None
    started_s: float = field(default_factory=time.time)
    prompts: int = 0  # good prompts in the file (up to max_prompts)
    malformed: int = 0
    #: Prompts of the file not asked (common/prompt_filter.py): duplicates of an earlier prompt of
    #: the run, and eval leaks; with duplicates = "share", the rows copied to shared.jsonl.
    duplicate_prompts: int = 0
    excluded: int = 0
    shared: Shared | None = None
    enqueued: int = 0
    resumed_rows: int = 0
    admission_ended_s: float | None = None
    #: When admission first ended (top-up rounds end it again later), and the rows kept by then.
    first_stop_s: float | None = None
    rows_at_first_stop: int | None = None
    finished_s: float | None = None
    top_ups: int = 0
    #: The state it was finalized with: what progress keeps showing for a finished dataset.
    final_state: DatasetState | None = None
    switch_s: float | None = None
    enqueue_s: float | None = None
    summary: Summary | None = None
    #: Its file on the way to its queue: the reads, the window, the counts.
    feed: Feed = field(default_factory=Feed)
    #: Its queue idle with prompts lacking an outcome: since when, and the sweeps so far.
    stall: Stall = field(default_factory=Stall)

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def admitting(self) -> bool:
        """Admission is open (or held for the plan): the runner watches the budget and the outcomes."""
        return self.phase in ADMITTING_PHASES

    @property
    def ended(self) -> bool:
        return self.phase is DatasetPhase.ENDED

    @property
    def outcome_key(self) -> str:
        """The set of ids with an outcome other than a failure: kept prompts, or ended conversations."""
        k = self.budget.keys
        return k.ended if self.cfg.regenerate == "all" else k.done

    def transition(self, to: DatasetPhase, reason: EndReason | None = None) -> None:
        """Move to ``to``; ``reason`` goes with (and only with) a move into draining. Only
        ``Lifecycle.step`` calls it in a run."""
        if to not in TRANSITIONS[self.phase] or (reason is None) == (to is DatasetPhase.DRAINING):
            raise IllegalTransition(f"{self.name}: {self.phase.value} -> {to.value}"
                                    + (f" ({reason.value})" if reason else ""))
        self.phase = to
        if to is DatasetPhase.DRAINING:
            self.end_reason = reason
        elif to is DatasetPhase.TOPPING_UP:
            self.end_reason = None


@dataclass(frozen=True)
class Move:
    """The move a handler names for the dataset it looked at: where to, and (into draining only) why."""

    to: DatasetPhase
    reason: EndReason | None = None


@dataclass(frozen=True)
class Look:
    """What a handler sees: the time, the dataset's state this tick (None at its opening, and when the
    plan refused the run), and the plan's refusal, which ends every admission."""

    now_s: float
    state: DatasetState | None = None
    refused: bool = False


#: A phase's handler: looks at a dataset in that phase, does what the phase does, and names the move
#: out of it (None: it stays). What a move out of the phase needs done (admission's end, a top-up's
#: reopening, the finalizing) the handler does before it names the move.
Handler = Callable[[DatasetRun, Look], "Move | None"]


class Lifecycle:
    """The state machine: one handler per phase that a dataset leaves (every phase but ended), and
    the one place a move is made."""

    def __init__(self, handlers: Mapping[DatasetPhase, Handler]) -> None:
        missing = set(TRANSITIONS) - {DatasetPhase.ENDED} - set(handlers)
        if missing:
            raise IllegalTransition("no handler for " + ", ".join(sorted(p.value for p in missing)))
        self._handlers = dict(handlers)

    def step(self, run: DatasetRun, look: Look) -> Move | None:
        """One look at ``run`` by its phase's handler; the move it names is made here."""
        handler = self._handlers.get(run.phase)
        move = handler(run, look) if handler is not None else None
        if move is not None:
            run.transition(move.to, move.reason)
        return move
