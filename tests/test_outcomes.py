"""One ``Outcome`` for every word budget.lua answers: a reply word the enum lacks fails here, not
in a worker that meets it on a busy day (``reply_outcome`` would raise there)."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest

from common.budget import reply_outcome
from common.errors import ScriptReplyError
from common.outcomes import REPLIES, SKIPPED, Grant, Outcome
from common.throttle import grant_of

SCRIPT = files("common").joinpath("budget.lua").read_text(encoding="utf-8")
THROTTLE = files("common").joinpath("throttle.lua").read_text(encoding="utf-8")

#: The producer's operations: their replies are acknowledgements with numbers (common/budget.py
#: reads them by position), not a prompt's outcome.
PRODUCER_OPS = {"run_open": {"run_open"}, "reap": {"reaped"}, "open": {"open"}, "close": {"closed"},
                "reconcile": {"current", "mismatch", "reconciled"}, "drop_rows": {"dropped"},
                "round_hold": set()}  # round_hold answers a number of tokens, no word
#: Outcomes the worker makes itself, never budget.lua (batched: batch mode's, workers/pipeline/batch/).
WORKERS_OWN = {Outcome.SPOOLED, Outcome.SKIPPED_STOPPED, Outcome.SKIPPED_OVER, Outcome.DEAD_LETTER, Outcome.BATCHED}


def replies(script: str) -> dict[str, set[str]]:
    """Each operation's reply words, read from the script: the literal first element of a
    ``return {...}``, and where it returns a word held in a variable (``{first}``: the answer an
    earlier execution recorded; ``{word}``), the words that section records or assigns."""
    heads = list(re.finditer(r'^(?:if|elseif) op == "(\w+)" then$', script, re.M))
    assert heads, "no operations found in budget.lua"
    out: dict[str, set[str]] = {}
    for head, after in zip(heads, [*heads[1:], None], strict=True):
        body = script[head.end():after.start() if after else len(script)]
        words = set(re.findall(r'return \{"(\w+)"', body))
        if re.search(r"return \{(first|word)\b", body):
            words |= set(re.findall(r'mark_applied\(id, lease, "(\w+)"', body))
            words |= set(re.findall(r'\bword = "(\w+)"', body))
        out[head.group(1)] = words
    return out


def test_every_operation_is_known() -> None:
    assert set(replies(SCRIPT)) == set(REPLIES) | set(PRODUCER_OPS)


@pytest.mark.parametrize("op", sorted(REPLIES))
def test_worker_operation_replies_are_the_table(op: str) -> None:
    assert replies(SCRIPT)[op] == {o.value for o in REPLIES[op]}
    for word in replies(SCRIPT)[op]:
        assert reply_outcome(op, word) == word


@pytest.mark.parametrize("op", sorted(PRODUCER_OPS))
def test_producer_operation_replies(op: str) -> None:
    assert replies(SCRIPT)[op] == PRODUCER_OPS[op]


def test_every_member_has_a_source() -> None:
    """A member nobody answers is dead: every one comes from a reply or is the worker's own."""
    answered = set().union(*REPLIES.values())
    assert set(Outcome) == answered | WORKERS_OWN
    assert not answered & WORKERS_OWN
    assert set(SKIPPED.values()) <= WORKERS_OWN and set(SKIPPED) <= REPLIES["reserve"]


def test_a_new_reply_word_fails() -> None:
    """The parse sees a word added to an operation (so the tests above would fail on it), and the
    decode refuses it."""
    grown = SCRIPT.replace('return {"lost"}', 'return {"misplaced"}', 1)
    assert grown != SCRIPT
    assert "misplaced" in replies(grown)["renew"]
    with pytest.raises(ValueError, match="misplaced"):
        reply_outcome("renew", "misplaced")
    with pytest.raises(ValueError, match="renew answered 'kept'"):
        reply_outcome("renew", "kept")


def test_the_word_is_the_wire_form() -> None:
    """A member is its word: what Celery logs, Flower shows and a log line's %s prints."""
    assert Outcome.SKIPPED_STOPPED == "skipped:stopped"
    assert str(Outcome.KEPT) == "kept" and f"{Outcome.DUPLICATE}" == "duplicate"
    assert type(str(Outcome.FAILED)) is str


def test_throttle_acquire_answers_the_grant_words() -> None:
    """throttle.lua's acquire answers ``Grant``'s words only; common/throttle.py decodes them, and
    refuses another."""
    body = THROTTLE[THROTTLE.index('if op == "acquire" then'):THROTTLE.index('elseif op == "release" then')]
    assert set(re.findall(r'return \{"(\w+)"', body)) == {g.value for g in Grant}
    assert grant_of("ok") is Grant.OK and grant_of("wait") is Grant.WAIT
    with pytest.raises(ScriptReplyError, match=r"throttle\.lua acquire answered 'granted'"):
        grant_of("granted")
