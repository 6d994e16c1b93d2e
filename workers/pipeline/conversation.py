"""A whole conversation, turn by turn (``regenerate = "all"``): every assistant turn produced again.

The dataset row is split at its assistant turns: segment k holds the dataset's non-assistant messages
(system, user, tool) that precede turn k, and the dataset's own assistant messages are dropped. Turn
k is asked with ``segment 0, turn 0, …, turn k-1, segment k``, where the turns are the target's own
regenerated messages (reasoning included: the chat template renders history as it renders history,
e.g. Kimi drops earlier reasoning), so the prompt ids of each row are what the model saw at that
turn. Each turn runs the five steps of ``workers/pipeline/job.py`` (single mode's ``generate``) as one
prompt whose id is the row key ``<id>#<turn>``: the budget admits, holds and counts per call, whatever its mode.

A kept turn's regenerated message is stored by the same ``budget.lua`` settle that counts its row
(``keys.DatasetKeys.turns``), so a redelivered conversation reads back exactly the turns that were
counted and continues after the last one: no turn is paid for twice. The conversation ends at the
turn that called tools (the dataset's tool results answered other calls), at a turn the dataset
follows with tool results the turn did not ask for, at a turn cut short (``length``: as history it
would read as finished), or at its last turn; that row says why
(``conversation_end``) and the conversation joins ``ended``. A failed turn (token mismatch, retries
exhausted, prompt too long) is that turn's failure and the conversation's outcome: later turns
depend on it. A budget stop leaves the kept turns kept; a later run with room continues from them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgpack

from common.budget import TurnKeep
from common.contract import ResultRow, TaskPayload, row_key
from common.keys import DatasetKeys
from common.outcomes import Outcome
from common.rebuild import ENDED_FINISH_REASONS, RebuiltRow
from workers.fleet.context import WorkerContext
from workers.pipeline.generate import generate
from workers.pipeline.job import Busy
from workers.upstreams.upstream import Answer

log = logging.getLogger(__name__)

#: Turn outcomes after which the turn's record is in Redis (ours, or another delivery's).
_SETTLED = frozenset({Outcome.KEPT, Outcome.DUPLICATE, Outcome.DONE})


@dataclass(frozen=True)
class Conversation:
    id: str
    #: The dataset's non-assistant messages before each turn; one segment per turn.
    segments: list[list[dict[str, Any]]]

    @classmethod
    def of(cls, payload: TaskPayload) -> Conversation:
        segments: list[list[dict[str, Any]]] = [[]]
        seen_user = after_assistant = False
        for m in payload["messages"]:
            # An assistant message before any user message is the dataset's context (a greeting),
            # not a turn: there is nothing for the target to answer yet.
            if m["role"] == "assistant" and seen_user:
                if not after_assistant:  # a run of assistant messages is one turn
                    segments.append([])
                after_assistant = True
                continue
            after_assistant = False
            seen_user = seen_user or m["role"] == "user"
            segments[-1].append(m)
        return cls(payload["id"], segments)

    @property
    def turns(self) -> int:
        return len(self.segments)

    def context(self, turn: int, regenerated: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages turn ``turn`` is asked with: the regenerated history and the dataset's own."""
        out: list[dict[str, Any]] = []
        for k in range(turn):
            out += [*self.segments[k], regenerated[k]]
        return out + self.segments[turn]

    def end_after(self, turn: int, called_tools: bool, finished: bool) -> str | None:
        """Why the conversation ends at ``turn`` (``contract.CONVERSATION_ENDS``), or None."""
        if called_tools:
            return "tool_calls"
        if not finished:
            return "cut"
        if turn == self.turns - 1:
            return "last_turn"
        if self.segments[turn + 1][0]["role"] == "tool":
            return "tool_results"
        return None


class Turn:
    """One turn as ``generate`` runs it (its ``TurnHook``)."""

    def __init__(self, conv: Conversation, index: int, regenerated: list[dict[str, Any]],
                 tool_call_open: str | None) -> None:
        self.conv, self.index = conv, index
        self.key = row_key(conv.id, index)
        self.messages = conv.context(index, regenerated)
        self._tool_call_open = tool_call_open

    def payload(self, conversation: TaskPayload) -> TaskPayload:
        return {**conversation, "id": self.key, "messages": self.messages}

    def finish(self, row: ResultRow, rebuilt: RebuiltRow, answer: Answer) -> TurnKeep:
        message = dict(rebuilt.assistant_message)
        if message.get("content") is None:  # history must render: Qwen3's template fails on null
            message["content"] = ""
        raw_call = bool(self._tool_call_open) and self._tool_call_open in (message["content"] or "")
        end = self.conv.end_after(self.index, bool(message.get("tool_calls")) or raw_call
                                  or answer.finish_reason == "tool_calls",
                                  answer.finish_reason in ENDED_FINISH_REASONS)
        row["id"], row["turn"], row["key"] = self.conv.id, self.index, self.key
        row["conversations"] = [*self.messages, message]  # as the next turn's history has it
        if end is not None:
            row["conversation_end"] = end
        record = msgpack.packb({"message": message, "end": end or ""}, use_bin_type=True)
        return TurnKeep(self.conv.id, record, end is not None)


def settled_turns(client: Any, dataset: str, conv: Conversation) -> list[dict[str, Any] | None]:
    """Each turn's stored record ({message, end}) or None, in turn order."""
    raw = client.hmget(DatasetKeys(dataset).turns, [row_key(conv.id, k) for k in range(conv.turns)])
    return [None if r is None else msgpack.unpackb(r, raw=False) for r in raw]


def generate_conversation(ctx: WorkerContext, payload: TaskPayload) -> Outcome | Busy:
    """Every turn not yet kept, in order; returns the outcome of the last turn asked (done when
    every turn was kept before this delivery), or Busy."""
    conv = Conversation.of(payload)
    tool_call_open = ctx.tokenizer(ctx.run(payload["run"])).turn_format.tool_call_open
    records = settled_turns(ctx.redis, payload["dataset"], conv)
    regenerated: list[dict[str, Any]] = []
    outcome = Outcome.DONE
    for index in range(conv.turns):
        record = records[index]
        if record is None:
            turn = Turn(conv, index, regenerated, tool_call_open)
            answer = generate(ctx, turn.payload(payload), turn)
            if isinstance(answer, Busy) or answer not in _SETTLED:
                return answer  # failed, skipped, halted…: the turns before stay kept
            # What the budget counted, ours or another delivery's: the next turn builds on that.
            record = settled_turns(ctx.redis, payload["dataset"], conv)[index]
            if record is None:  # done by a failure of another delivery: that is the outcome
                return answer
            outcome = answer
        if record["end"]:
            log.info("%s/%s conversation: %d turns, ended (%s)", payload["dataset"], conv.id, index + 1,
                     record["end"])
            return outcome
        regenerated.append(record["message"])
    return outcome

