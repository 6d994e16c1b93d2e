"""An upstream's answer → the token-exact row the target model emitted, checked before it is kept.

The upstream parsed its own wire format into an ``Answer`` (``workers/upstreams/upstream.py``); this module
knows only the target's template and tokenizer, and reads only the answer's four parts
(``AnswerParts``). It lives in ``common/`` because the workers build rows with it and
``specfleet validate`` (``producer/validate.py``) rebuilds a row's completion from its
``conversations`` with it, the same code both ways.

``input_ids = prompt ids + completion ids``: the prompt is the template rendered with the generation
prompt (what the model saw); the completion is the assistant turn rebuilt from the answer's parts in
the template's own layout (``TurnFormat``), with the edges the template strips from reasoning and
content stripped (whether the provider kept the newlines around them or not, the model emitted the
template's glue once), encoded as generated text (no normalizer). Never render the finished
conversation and cut it: Kimi's templates render a final turn without tool calls as history and
drop its reasoning.

Every row passes three self-checks or raises ``TokenMismatch``: the completion ids decode back to
the rebuilt text; every special-token string in that text became its single id; and, where the
template keeps the turn's reasoning, rendering ``messages + [assistant]`` gives the same turn.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from common.errors import TokenMismatch
from common.target import TargetTokenizer, TurnFormat

ReasoningEnd = Literal["explicit", "implicit", "none", "truncated"]

# Only these mean the model emitted its end-of-turn token; on ``length`` (or a filter/error cut)
# the generation stopped mid-turn and appending one would teach the drafter a token never emitted.
ENDED_FINISH_REASONS = frozenset({"stop", "tool_calls"})

_KIMI_CALL_ID = re.compile(r"functions\.(?P<name>.+):(?P<index>\d+)", re.DOTALL)


class AnswerParts(Protocol):
    """What a rebuild reads of an answer (``workers/upstreams/upstream.Answer`` has these and more):
    ``None`` = absent, ``""`` = present and empty."""

    @property
    def reasoning(self) -> str | None: ...

    @property
    def content(self) -> str | None: ...

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None: ...

    @property
    def finish_reason(self) -> str: ...


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt as the model saw it: the template rendered with the generation prompt, and its
    ids. Rendered once per prompt (``render_prompt``), counted before any money is spent, reused
    here."""

    text: str
    ids: list[int]


def render_prompt(
    target: TargetTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> RenderedPrompt:
    text = target.render(messages, tools, add_generation_prompt=True)
    return RenderedPrompt(text, target.encode(text))


@dataclass(frozen=True)
class RebuiltRow:
    """One training row. ``completion_tokens == sum(loss_mask)``: the count the budget charges.

    ``reasoning_end``: ``explicit`` the completion closes reasoning with the think-close token (also
    for an empty reasoning the template writes as ``<think></think>``); ``implicit`` a tool-call
    section opened inside the reasoning without it; ``truncated`` the generation stopped inside the
    reasoning; ``none`` the completion has no reasoning block.
    """

    input_ids: list[int]
    loss_mask: list[int]
    prompt_tokens: int
    completion_tokens: int
    completion_text: str
    assistant_message: dict[str, Any]
    reasoning_end: ReasoningEnd
    #: With an engine's ids (``workers/pipeline/engine_ids.py``): how the text rebuild compared with them.
    engine_check: dict[str, Any] | None = None


def rebuild(
    target: TargetTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    answer: AnswerParts,
    *,
    prompt: RenderedPrompt | None = None,
) -> RebuiltRow:
    """Rebuild ``answer`` as the token ids the model produced after ``messages``; self-checked.

    ``prompt``: the already rendered prompt (the worker's prepare step); rendered here when absent."""
    if prompt is None:
        prompt = render_prompt(target, messages, tools)
    prompt_text, prompt_ids = prompt.text, prompt.ids
    turn = _assemble(target, messages, answer)
    completion_ids = target.encode_generated(turn.text)

    _check_round_trip(target, turn.text, completion_ids)
    _check_special_ids(target, turn.text, completion_ids)
    if turn.template_checkable:
        _check_template(target, messages, tools, turn.message, prompt_text, turn.text, completion_ids)

    return RebuiltRow(
        input_ids=prompt_ids + completion_ids,
        loss_mask=[0] * len(prompt_ids) + [1] * len(completion_ids),
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(completion_ids),
        completion_text=turn.text,
        assistant_message=turn.message,
        reasoning_end=turn.reasoning_end,
    )


# --- assembling the turn ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Turn:
    text: str
    message: dict[str, Any]
    reasoning_end: ReasoningEnd
    template_checkable: bool


def _assemble(target: TargetTokenizer, messages: list[dict[str, Any]], answer: AnswerParts) -> _Turn:
    fmt = target.turn_format
    ended = answer.finish_reason in ENDED_FINISH_REASONS
    ends = _end_strings(target)
    reasoning = answer.reasoning
    content = _strip_end(answer.content, ends)
    calls = _normalise_tool_calls(answer.tool_calls, messages, fmt) if answer.tool_calls else None

    raw_tool_text = None
    if reasoning and not content and fmt.tool_call_open and fmt.tool_call_open in reasoning:
        # Kimi may open its tool-call section without closing reasoning; a reasoning parser that
        # does not know that hands the whole section over as reasoning. Keep it as emitted.
        at = reasoning.index(fmt.tool_call_open)
        reasoning, raw_tool_text = reasoning[:at], _strip_end(reasoning[at:], ends)
        # No think-close follows, so the template's glue after the reasoning was never emitted.
        reasoning = fmt.reasoning_edges.apply(reasoning, trail=False)
    elif reasoning and not content and not calls:
        reasoning = _strip_end(reasoning, ends)

    if reasoning is not None and fmt.think_close is None:
        if reasoning:
            raise TokenMismatch("shape", -1, "answer has reasoning but the template has no reasoning block")
        reasoning = None

    parts: list[str] = []
    reasoning_end: ReasoningEnd
    if raw_tool_text is not None:
        parts += [fmt.reasoning_prefix, reasoning or "", raw_tool_text]
        reasoning_end = "implicit"
    elif not content and not calls and not ended:
        # Cut off before any content: the model was still reasoning (hidden reasoning reads as "").
        # Its end is text the model emitted, not glue before a think-close.
        reasoning = fmt.reasoning_edges.apply(reasoning, trail=False) if reasoning else reasoning
        parts += [fmt.reasoning_prefix, reasoning or ""]
        reasoning_end = "truncated" if fmt.think_close is not None else "none"
    else:
        # The template writes its own glue around reasoning and content and strips theirs: a
        # provider that kept the newlines the model emitted as glue hands them over as text.
        content_edges = fmt.plain_content_edges if reasoning is None else fmt.content_edges
        if content is not None:
            content = content_edges.apply(content, trail=ended or bool(calls))
        if reasoning is None:
            parts.append(fmt.no_reasoning_prefix)
            has_close = fmt.think_close is not None and fmt.think_close in fmt.no_reasoning_prefix
            reasoning_end = "explicit" if has_close else "none"
        else:
            reasoning = fmt.reasoning_edges.apply(reasoning)
            parts += [fmt.reasoning_prefix, reasoning, fmt.reasoning_suffix]
            reasoning_end = "explicit"
        parts.append(content or "")
        if calls:
            if fmt.tool_call_style == "none":
                raise TokenMismatch("shape", -1, "answer has tool calls but the template renders none")
            parts.append(target.render_tool_calls(content or "", calls))
    if ended:
        parts.append(fmt.end_of_turn)

    message: dict[str, Any] = {"role": "assistant", "content": content}
    if raw_tool_text is not None and not calls:
        message["content"] = raw_tool_text
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls

    keeps = fmt.keeps_final_reasoning_with_tool_calls if calls else fmt.keeps_final_reasoning
    checkable = ended and reasoning_end != "implicit" and (keeps or not reasoning)
    return _Turn("".join(parts), message, reasoning_end, checkable)


def _end_strings(target: TargetTokenizer) -> tuple[str, ...]:
    fmt = target.turn_format
    ends = [fmt.end_of_turn + fmt.end_of_turn_tail, fmt.end_of_turn]
    if target.eos_token:
        ends.append(target.eos_token)
    return tuple(dict.fromkeys(e for e in ends if e))


def _strip_end(text: str | None, ends: tuple[str, ...]) -> str | None:
    """Drop end tokens a provider leaked at the end of a text; the real one is appended once."""
    if text is None:
        return None
    stripped = True
    while stripped:
        stripped = False
        for end in ends:
            if text.endswith(end):
                text, stripped = text[: -len(end)], True
    return text


def _normalise_tool_calls(
    calls: list[dict[str, Any]], messages: list[dict[str, Any]], fmt: TurnFormat
) -> list[dict[str, Any]]:
    """OpenAI-shaped calls; where the template writes the id into the tokens (Kimi), an id the
    model cannot have produced is replaced by the ``functions.{name}:{idx}`` form it emits, ``idx``
    counting the conversation's tool calls from 0 (Kimi's counter is per conversation)."""
    earlier = sum(len(m.get("tool_calls") or []) for m in messages if m.get("role") == "assistant")
    out = []
    for index, call in enumerate(calls):
        function = dict(call.get("function") or {})
        name = str(function.get("name") or "")
        arguments = function.get("arguments")
        call_id = call.get("id")
        if fmt.tool_call_ids_rendered:
            match = _KIMI_CALL_ID.fullmatch(call_id) if isinstance(call_id, str) else None
            if match is None or match.group("name") != name:
                call_id = f"functions.{name}:{earlier + index}"
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": "" if arguments is None else arguments},
            }
        )
    return out


# --- self-checks --------------------------------------------------------------------------------


def _check_round_trip(target: TargetTokenizer, text: str, ids: list[int]) -> None:
    decoded = target.decode(ids)
    if decoded == text:
        return
    # Binary search for the first token whose decode leaves the text: prefixes that still agree
    # are monotone (a trailing U+FFFD is a multi-byte character cut by the prefix, not a mismatch).
    good, bad = 0, len(ids)
    while bad - good > 1:
        mid = (good + bad) // 2
        if text.startswith(target.decode(ids[:mid]).rstrip("\ufffd")):
            good = mid
        else:
            bad = mid
    raise TokenMismatch(
        "decode", good, f"completion ids decode to {_clip(decoded)}, rebuilt text is {_clip(text)}"
    )


def _check_special_ids(target: TargetTokenizer, text: str, ids: list[int]) -> None:
    wanted = [(m.start(), target.special_ids_by_string[m.group()]) for m in target.specials_in(text)]
    found = [(pos, tid) for pos, tid in enumerate(ids) if tid in target.special_ids]
    for k in range(max(len(wanted), len(found))):
        want = wanted[k][1] if k < len(wanted) else None
        got = found[k][1] if k < len(found) else None
        if want == got:
            continue
        # Where it went wrong: the token at which the k-th special should have started.
        position = len(target.encode_generated(text[: wanted[k][0]])) if k < len(wanted) else found[k][0]
        raise TokenMismatch(
            "special",
            position,
            f"special token #{k}: text has {_name(target, want)}, ids have {_name(target, got)}",
        )


def _check_template(
    target: TargetTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    assistant: dict[str, Any],
    prompt_text: str,
    completion_text: str,
    completion_ids: list[int],
) -> None:
    fmt = target.turn_format
    message = dict(assistant)
    # The rebuilt text reads an absent content as "", and an absent reasoning as the empty block
    # where the template writes one for it; say so to the template too (Qwen3's reads reasoning
    # out of the content when none is given, and fails on a null content).
    if message.get("content") is None:
        message["content"] = ""
    empty_block = fmt.reasoning_prefix + fmt.reasoning_suffix
    if fmt.reasoning_key and "reasoning_content" not in message and fmt.no_reasoning_prefix == empty_block:
        message["reasoning_content"] = ""
    if "reasoning_content" in message and fmt.reasoning_key and fmt.reasoning_key != "reasoning_content":
        message[fmt.reasoning_key] = message.pop("reasoning_content")
    full = target.render([*messages, message], tools, add_generation_prompt=False)
    expected = completion_text + fmt.end_of_turn_tail
    if full.startswith(prompt_text):
        if full == prompt_text + expected:
            return
        turn = full[len(prompt_text) :]
    else:
        # Adding this turn made the template re-render earlier turns (Kimi drops the reasoning of
        # earlier tool-call turns once a final answer exists). The turn itself must still match.
        if full.endswith(fmt.generation_prompt + expected):
            return
        cut = full.rfind(fmt.generation_prompt)
        turn = full[cut + len(fmt.generation_prompt) :] if cut >= 0 else full
    if fmt.end_of_turn_tail and turn.endswith(fmt.end_of_turn_tail):
        turn = turn[: -len(fmt.end_of_turn_tail)]
    position = _first_difference(target.encode_generated(turn), completion_ids)
    raise TokenMismatch(
        "template", position, f"template renders the turn as {_clip(turn)}, rebuilt {_clip(completion_text)}"
    )


# --- small helpers ------------------------------------------------------------------------------


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _name(target: TargetTokenizer, token_id: int | None) -> str:
    if token_id is None:
        return "nothing"
    names = [s for s, i in target.special_ids_by_string.items() if i == token_id]
    return f"{names[0]!r} ({token_id})" if names else str(token_id)


def _clip(text: str, limit: int = 160) -> str:
    return repr(text) if len(text) <= limit else repr(text[: limit // 2]) + "…" + repr(text[-limit // 2 :])
