"""The dataset run's state machine (``producer/dataset_run.py``): every move its table names is
taken, every other one raises, a move into draining (only that one) carries its end reason, and the
machine makes the move the handler of the phase being left names (one handler per phase)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import DatasetConfig
from common.errors import IllegalTransition
from producer.dataset_run import (
    ADMITTING_PHASES,
    TRANSITIONS,
    DatasetPhase,
    DatasetRun,
    EndReason,
    Lifecycle,
    Look,
    Move,
)

P = DatasetPhase

#: The moves the runner makes, written out here rather than read from the table under test.
LEGAL = {
    (P.QUEUED, P.PLANNING), (P.QUEUED, P.ADMITTING), (P.QUEUED, P.DRAINING),
    (P.PLANNING, P.ADMITTING), (P.PLANNING, P.DRAINING),
    (P.ADMITTING, P.DRAINING),
    (P.DRAINING, P.TOPPING_UP), (P.DRAINING, P.ENDED),
    (P.TOPPING_UP, P.DRAINING),
}


def _run(phase: DatasetPhase) -> DatasetRun:
    cfg = DatasetConfig(name="d", path=Path("d.jsonl"), length="short", budget_tokens=1_000)
    run = DatasetRun(cfg=cfg, budget=None)  # type: ignore[arg-type]  # no move reads the budget
    run.phase = phase
    return run


def test_the_table_is_exactly_the_moves_the_runner_makes() -> None:
    assert {(a, b) for a, tos in TRANSITIONS.items() for b in tos} == LEGAL
    assert set(TRANSITIONS) == set(DatasetPhase)
    assert {P.PLANNING, P.ADMITTING, P.TOPPING_UP} == ADMITTING_PHASES


@pytest.mark.parametrize(("start", "to"), sorted(LEGAL))
def test_every_legal_move_is_taken(start: DatasetPhase, to: DatasetPhase) -> None:
    run = _run(start)
    reason = EndReason.BUDGET if to is P.DRAINING else None
    run.transition(to, reason)
    assert run.phase is to
    if to is P.DRAINING:
        assert run.end_reason is EndReason.BUDGET
    with pytest.raises(IllegalTransition):  # draining without its reason, or any other with one
        _run(start).transition(to, None if reason else EndReason.COMPLETE)


@pytest.mark.parametrize(("start", "to"), sorted({(a, b) for a in P for b in P} - LEGAL))
def test_every_other_move_raises_and_changes_nothing(start: DatasetPhase, to: DatasetPhase) -> None:
    run = _run(start)
    with pytest.raises(IllegalTransition, match=f"{start.value} -> {to.value}"):
        run.transition(to, EndReason.STALLED if to is P.DRAINING else None)
    assert run.phase is start and run.end_reason is None


def test_a_top_up_round_clears_the_reason_and_the_next_end_sets_it_again() -> None:
    run = _run(P.ADMITTING)
    run.transition(P.DRAINING, EndReason.BUDGET)
    assert not run.admitting and not run.ended
    run.transition(P.TOPPING_UP)
    assert run.end_reason is None and run.admitting
    run.transition(P.DRAINING, EndReason.COMPLETE)
    run.transition(P.ENDED)
    assert run.ended and run.end_reason is EndReason.COMPLETE and not run.admitting
    with pytest.raises(IllegalTransition):
        run.transition(P.ADMITTING)


def test_end_reasons_keep_summary_jsons_words_and_which_leave_requests_to_land() -> None:
    assert [r.value for r in EndReason] == ["budget", "budget_usd", "run_budget", "complete", "stalled", "refused"]
    assert {r for r in EndReason if r.by_budget} == {EndReason.BUDGET, EndReason.BUDGET_USD, EndReason.RUN_BUDGET}


def test_the_machine_makes_the_move_the_phase_being_left_names() -> None:
    seen: list[tuple[DatasetPhase, Look]] = []

    def stay(run: DatasetRun, look: Look) -> Move | None:
        seen.append((run.phase, look))
        return None

    def end(run: DatasetRun, look: Look) -> Move | None:
        seen.append((run.phase, look))
        return Move(P.DRAINING, EndReason.STALLED)

    machine = Lifecycle({P.QUEUED: stay, P.PLANNING: stay, P.ADMITTING: end, P.TOPPING_UP: stay, P.DRAINING: stay})
    run, look = _run(P.ADMITTING), Look(1.0)
    assert machine.step(run, look) == Move(P.DRAINING, EndReason.STALLED)
    assert run.phase is P.DRAINING and run.end_reason is EndReason.STALLED
    assert machine.step(run, look) is None and run.phase is P.DRAINING  # draining's handler: it stays
    assert seen == [(P.ADMITTING, look), (P.DRAINING, look)]
    assert machine.step(_run(P.ENDED), look) is None  # nothing leaves ended: no handler is asked
    assert len(seen) == 2


def test_a_move_the_table_does_not_name_is_refused_whoever_names_it() -> None:
    machine = Lifecycle({p: (lambda run, look: Move(P.ENDED)) for p in P if p is not P.ENDED})
    run = _run(P.ADMITTING)
    with pytest.raises(IllegalTransition, match="admitting -> ended"):
        machine.step(run, Look(1.0))
    assert run.phase is P.ADMITTING


def test_every_phase_that_is_left_has_its_handler() -> None:
    with pytest.raises(IllegalTransition, match="no handler for draining"):
        Lifecycle({p: (lambda run, look: None) for p in P if p not in (P.DRAINING, P.ENDED)})
