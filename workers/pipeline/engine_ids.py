"""Rows from an engine's own ids, with the text rebuild as the cross-check.

An engine that returns token ids (``workers/upstreams/vllm.py``) reports what the model really sampled; the
text rebuild (``common/rebuild.py``) re-encodes the answer's text, which gives the *canonical*
tokenization. The two differ when the model sampled a non-canonical split (``"hel" + "lo"``), a
difference no self-check on the text can see. So with ids:

- the row's ``input_ids`` are the engine's (prompt ids + completion ids, ``loss_mask`` over the
  completion) and ``num_tokens`` counts the engine's completion ids;
- the rebuild still runs, and the row's ``engine_check`` says whether it agreed: ``match``; if not,
  the first differing completion ``position``, the token at it on each side (``engine``/``rebuilt``
  as text, ``engine_id``/``rebuilt_id``), or the rebuild's own ``rebuild_error`` when it failed its
  self-checks. The row is kept either way: the engine's ids are the truth, the count says how
  often text-only rebuilding would have been wrong (or would have lost the row);
- the engine's prompt ids are compared with the prompt the worker rendered with the target's chat
  template (``prompt_match``, ``prompt_position``): a difference means the engine serves another
  chat template than the tokenizer the run names. Every such row's prompt is not what the run's
  tokenizer says it is, so under ``[model] engine_prompt_mismatch = "refuse"`` (the default) the
  first one halts the run (``prompt_refusal`` says where and what to fix; the generate step halts);
  under ``"warn"`` the row is kept and counted (``engine_prompt_mismatch``), the summary and report
  warning per dataset.

Where the turn ended (``stop``/``tool_calls``) and the engine trimmed the stop token it sampled
(SGLang without ``no_stop_trim``), the end-of-turn id is put back (``end_appended``), as the text
rebuild does for providers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from common.contract import halt_message
from common.errors import TokenMismatch
from common.rebuild import ENDED_FINISH_REASONS, ReasoningEnd, RebuiltRow, RenderedPrompt, rebuild
from common.target import TargetTokenizer
from workers.upstreams.upstream import Answer


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _token(target: TargetTokenizer, ids: Sequence[int], i: int) -> tuple[str, int | None]:
    return (target.decode([ids[i]]), ids[i]) if i < len(ids) else ("", None)


def engine_completion(target: TargetTokenizer, answer: Answer) -> tuple[list[int], bool]:
    """The engine's completion ids, with the end-of-turn id put back where the engine trimmed it."""
    ids = list(answer.completion_ids or [])
    if answer.finish_reason not in ENDED_FINISH_REASONS:
        return ids, False
    end = target.special_ids_by_string.get(target.turn_format.end_of_turn)
    stops = {end} | ({target.special_ids_by_string.get(target.eos_token)} if target.eos_token else set())
    if end is None or (ids and ids[-1] in stops):
        return ids, False
    return [*ids, end], True


#: The end of a prompt-mismatch halt line: what the user can do about it.
PROMPT_MISMATCH_FIX = ("serve the model's own chat template on the engine (its tokenizer_config.json), "
                       'or set [model] engine_prompt_mismatch = "warn"')


def prompt_refusal(target: TargetTokenizer, dataset: str, prompt_id: str, where: str,
                   engine_prompt: Sequence[int], rendered: Sequence[int]) -> str | None:
    """Why the run is refused for this answer's prompt ids (None when they are the rendered ones):
    the dataset, the prompt, the first differing token on each side, and the fix."""
    position = first_difference(engine_prompt, rendered)
    if position is None:
        return None
    engine_text, _ = _token(target, engine_prompt, position)
    rendered_text, _ = _token(target, rendered, position)
    # Where they differ first, the file:line last: a long path is what the 300 characters cut.
    what = (f"dataset {dataset}, prompt {prompt_id}: engine prompt ids differ from the run tokenizer's chat "
            f"template at token {position} (engine {engine_text!r}, rendered {rendered_text!r}) at {where}")
    return halt_message(what, PROMPT_MISMATCH_FIX)


def rebuild_from_engine(
    target: TargetTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    answer: Answer,
    *,
    prompt: RenderedPrompt,
) -> RebuiltRow:
    """The row from the engine's ids, ``engine_check`` filled from the text rebuild. A rebuild that
    fails its own self-checks (which would fail the row without ids) is a mismatch too: the row
    keeps the engine's ids, the answer's parts as its message and the check's ``rebuild_error``."""
    engine_prompt = list(answer.prompt_ids or [])
    completion, end_appended = engine_completion(target, answer)
    check: dict[str, Any] = {"match": True, "prompt_match": True}
    try:
        rebuilt = rebuild(target, messages, tools, answer, prompt=prompt)
    except TokenMismatch as exc:
        rebuilt = _unchecked(target, answer, completion)
        check.update(match=False, position=exc.position, rebuild_error=str(exc))

    position = first_difference(completion, rebuilt.input_ids[rebuilt.prompt_tokens:]) if check["match"] else None
    if position is not None:
        engine_text, engine_id = _token(target, completion, position)
        rebuilt_text, rebuilt_id = _token(target, rebuilt.input_ids[rebuilt.prompt_tokens:], position)
        check.update(match=False, position=position, engine=engine_text, rebuilt=rebuilt_text,
                     engine_id=engine_id, rebuilt_id=rebuilt_id)
    prompt_position = first_difference(engine_prompt, prompt.ids)
    if prompt_position is not None:
        check.update(prompt_match=False, prompt_position=prompt_position)
    if end_appended:
        check["end_appended"] = True

    return dataclasses.replace(
        rebuilt,
        input_ids=engine_prompt + completion,
        loss_mask=[0] * len(engine_prompt) + [1] * len(completion),
        prompt_tokens=len(engine_prompt),
        completion_tokens=len(completion),
        engine_check=check,
    )


def _unchecked(target: TargetTokenizer, answer: Answer, completion: list[int]) -> RebuiltRow:
    """The row's other fields straight from the answer and the engine's ids, for when the text
    rebuild refused them (the ids and counts are the engine's, set by the caller)."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    close = target.special_ids_by_string.get(target.turn_format.think_close or "")
    reasoning_end: ReasoningEnd = "none"
    if close is not None and close in completion:
        reasoning_end = "explicit"
    elif answer.reasoning and answer.finish_reason not in ENDED_FINISH_REASONS:
        reasoning_end = "truncated"
    return RebuiltRow(input_ids=[], loss_mask=[], prompt_tokens=0, completion_tokens=0,
                      completion_text=target.decode(completion), assistant_message=message,
                      reasoning_end=reasoning_end)


__all__ = ["PROMPT_MISMATCH_FIX", "engine_completion", "first_difference", "prompt_refusal", "rebuild_from_engine"]
