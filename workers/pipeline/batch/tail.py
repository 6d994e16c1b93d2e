"""Batch mode's tail: once the room a dataset's budget has left is less than a full batch's worst
cases, the rest goes live (``[request] tail = "live"``, the default).

Under the hard rule a round admits only what fits beside the worst cases already out, and gets back
about a quarter of it (answers are shorter than their worst case): below a full batch, each round is a
smaller batch and a whole batch latency (minutes to hours at OpenRouter), ~10 rounds to the end. Live,
the same room is filled at the speed of live answers. What goes live is bounded: the room is less
than ``batch_size`` worst cases of tokens, paid at the live price.

The room is the limit less what is kept and less what is out at the kept mean, not less what is held:
while a round is out its holds fill the budget, and the requests waiting beside it must wait for
that round (it lands shorter than held), not conclude that the budget is spent; but what the round
will most likely keep is no room for another batch round. Token budgets only: a dollar budget's end
stays the budget's rule.
"""

from __future__ import annotations

import time

from common.budget import POLICY, Budget
from common.config import WorkerView

#: How long one read of a dataset's budget serves the process's tasks: thousands of them wait on it,
#: each asking every second.
READ_EVERY_S = 0.5

_ROOM: dict[str, tuple[float, int]] = {}


def room_tokens(budget: Budget) -> int:
    """The token room expected once what is out has landed (read at most every ``READ_EVERY_S``
    per dataset): a request that finds it under a full batch goes live, though the round still out
    left room free as its first batches landed (another batch round would cost a latency more)."""
    now = time.monotonic()
    seen = _ROOM.get(budget.keys.dataset)
    if seen is None or now - seen[0] >= READ_EVERY_S:
        snap = budget.snapshot()
        # A budget not opened (no limit yet) is no tail: its room is unknown, not empty.
        room = snap.expected_room_tokens(POLICY.trust_rows) if snap.limit > 0 else 1 << 62
        seen = _ROOM[budget.keys.dataset] = (now, room)
    return seen[1]


def full_batch_tokens(view: WorkerView, worst_tokens: int) -> int:
    """What a full batch's worst cases hold: ``batch_size`` x one request's worst case."""
    assert view.batch is not None
    return view.batch.size * worst_tokens


def goes_live(view: WorkerView, budget: Budget, worst_tokens: int) -> bool:
    """``tail = "live"`` and the room is less than a full batch's worst cases."""
    if view.batch is None or view.batch.tail != "live":
        return False
    return room_tokens(budget) < full_batch_tokens(view, worst_tokens)
