"""Every answer's billed usage against the fleet's own counts: a wrong tokenizer or template noticed.

The provider counts the tokens its model read and wrote; the fleet counts the ids it rendered and
rebuilt with the run's tokenizer. They differ by a constant that belongs to the model and its
server: an end-of-turn token the provider does not count (``completion = -1``), a BOS it adds to the
prompt (``prompt = 1``). ``[model] usage_offset = {prompt = …, completion = …}`` declares it; absent,
it is learned, per provider: the most common difference among its answers checked so far, frozen
after the run's first ``usage_check_answers`` (the run config's hash ``keys.usage_check``, ``usage_check.lua``). Any
other difference means the ids differ from what the model read or wrote: another tokenizer
revision, a converted tokenizer, another chat template. The row keeps its ids and says so
(``usage_check``); past ``usage_mismatch_max`` of the first ``usage_check_answers`` the run halts
(``usage_check = "halt"``, the default) before it pays for more rows like them.
"""

from __future__ import annotations

import math
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import redis

from common.config import ModelConfig, WorkerView
from common.contract import Usage, halt_message
from common.keys import usage_check

_SCRIPT = files("common").joinpath("usage_check.lua").read_text(encoding="utf-8")
#: The learned offset outlives a halted run long enough for its resume to see it.
USAGE_CHECK_TTL_S = 30 * 86_400

#: The end of a usage halt line: what the user can do about it.
USAGE_FIX = ("check that [model] tokenizer is the served model's (files, revision, template), or declare "
             "[model] usage_offset")

_SCRIPTS: weakref.WeakKeyDictionary[redis.Redis, Any] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class UsageVerdict:
    """One answer's comparison, and the run's standing after it."""

    #: The answer's billed tokens minus the fleet's counts (prompt ids; completion ids with the
    #: end-of-turn token the fleet appends).
    prompt_diff: int
    completion_diff: int
    #: The offset the answer was held to (declared, or learned so far).
    expected_prompt: int
    expected_completion: int
    match: bool
    #: Answers that disagreed among the first ``usage_check_answers``, and whether that is past the limit.
    mismatches: int
    over_limit: bool

    def row_field(self) -> dict[str, Any]:
        """The row's ``usage_check``: whether it agreed and both differences; the expected ones if not."""
        field: dict[str, Any] = {"match": self.match, "prompt_diff": self.prompt_diff,
                                 "completion_diff": self.completion_diff}
        if not self.match:
            field["expected"] = {"prompt": self.expected_prompt, "completion": self.expected_completion}
        return field


def differences_disagreeing(samples: Sequence[tuple[int, int, bool]]) -> int:
    """Offline, over a finished dataset's rows (``specfleet validate``): how many of the ``(prompt
    diff, completion diff, ended)`` samples disagree with the most common differences (the prompt's
    over all, the completion's over the ended ones; a cut answer's completion agrees at C or C + 1),
    the rule ``usage_check.lua`` applies with a learned offset."""
    prompt_mode = Counter(p for p, _, _ in samples).most_common(1)
    completion_mode = Counter(c for _, c, ended in samples if ended).most_common(1)
    ep = prompt_mode[0][0] if prompt_mode else None
    ec = completion_mode[0][0] if completion_mode else None
    return sum(1 for p, c, ended in samples
               if (ep is not None and p != ep)
               or (ec is not None and not (c == ec or (not ended and c == ec + 1))))


def allowed_mismatches(model: ModelConfig) -> int:
    """How many of the first ``usage_check_answers`` may disagree without halting the run."""
    return math.floor(model.usage_mismatch_max * model.usage_check_answers + 1e-9)


def halt_text(verdict: UsageVerdict, model: ModelConfig, where: str) -> str:
    """The halt's one line (within ``HALT_MESSAGE_MAX_CHARS``): how many disagreed, this answer's
    numbers and where, then what to check."""
    what = (f"{verdict.mismatches} of the first {model.usage_check_answers} answers billed token counts unlike the "
            f"run tokenizer's (over {model.usage_mismatch_max:.0%}); the last billed - counted "
            f"{verdict.prompt_diff:+d}/{verdict.completion_diff:+d} (prompt/completion), expected "
            f"{verdict.expected_prompt:+d}/{verdict.expected_completion:+d}, at {where}")
    return halt_message(what, USAGE_FIX)


def check_usage(client: redis.Redis, config_id: str, view: WorkerView, usage: Usage, *,
                prompt_tokens: int, completion_tokens: int, ended: bool, provider: str = "") -> UsageVerdict | None:
    """The verdict on one answer of the run ``config_id`` (None: not checked: ``usage_check = "off"``,
    or no usage billed). Learned per run config and manifest (a resume whose tokenizer files were
    fixed, another manifest id, learns afresh; one with the same files meets its halt again) and
    per ``provider`` (each counts in its own way; the halt counts them all)."""
    model = view.model
    if model.usage_check == "off" or (usage["prompt_tokens"] == 0 and usage["completion_tokens"] == 0):
        return None
    script = _SCRIPTS.get(client)
    if script is None:
        script = _SCRIPTS[client] = client.register_script(_SCRIPT)
    offset = model.usage_offset
    declared = "" if offset is None else f"{offset.prompt}:{offset.completion}"
    p = usage["prompt_tokens"] - prompt_tokens
    c = usage["completion_tokens"] - completion_tokens
    reply = script(keys=[usage_check(config_id, view.manifest)],
                   args=[p, c, 1 if ended else 0, model.usage_check_answers, allowed_mismatches(model), declared,
                         USAGE_CHECK_TTL_S, provider])
    match, ep, ec, mismatches, over = (int(x) for x in reply)
    return UsageVerdict(p, c, ep, ec, bool(match), mismatches, bool(over))


__all__ = ["USAGE_CHECK_TTL_S", "UsageVerdict", "allowed_mismatches", "check_usage", "differences_disagreeing",
           "halt_text"]
