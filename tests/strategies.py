"""Hypothesis generators for API answers and the conversations they answer.

Reused by the rebuild property test and (later) the simulator/worker path tests. Texts mix
arbitrary Unicode with every special-token string of the test tokenizers and near-misses of them,
so rows that hold raw special-token text are the common case, not the rare one.

Excluded on purpose: lone surrogates (Unicode category ``Cs``). They are not characters, cannot be
encoded as UTF-8, so no tokenizer can take them and an API answer (UTF-8 JSON) cannot carry them.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from harness.tokenizer_factory import CHATML_ADDED, CHATML_SPECIALS, DEEPSEEK_ADDED, DEEPSEEK_SPECIALS, KIMI_SPECIALS

SPECIAL_STRINGS = tuple(
    dict.fromkeys(KIMI_SPECIALS + CHATML_SPECIALS + CHATML_ADDED + DEEPSEEK_SPECIALS + DEEPSEEK_ADDED)
)
NEAR_MISSES = (
    "<|im_end", "im_end|>", "</think", "<think >", "<|tool_call_begin|", "<tool_call", "[EOS", "<|",
    "<｜end▁of▁sentence", "<｜tool▁sep", "<｜",
)
FINISH_REASONS = ("stop", "length", "tool_calls", "content_filter")
# Tool-call text as the models emit it; inside reasoning (content empty) it is an implicit end.
RAW_TOOL_TEXT = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>",
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
)
# The newlines a reasoning parser that keeps them leaves around Qwen3's think block.
_KEPT_NEWLINES = (("", ""), ("\n", "\n"), ("\n", "\n\n"))

_unicode = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=24)
_emoji_and_scripts = st.sampled_from(
    ("🙂", "👍🏽", "👩‍💻", "🇫🇷", "你好", "Straße", "Привет", "مرحبا", "e\u0301", "\u200b", "\n", " ", "\t")
)

# Text pieces: arbitrary Unicode, special-token strings, near-misses, emoji and other scripts.
text_pieces = st.one_of(_unicode, st.sampled_from(SPECIAL_STRINGS), st.sampled_from(NEAR_MISSES), _emoji_and_scripts)
texts = st.lists(text_pieces, max_size=6).map("".join)

# None, "" and text are three different answers; all three must rebuild.
optional_texts = st.one_of(st.none(), st.just(""), texts)

tool_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_-]{0,20}", fullmatch=True)
_arguments = st.one_of(
    st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), st.one_of(st.integers(), texts), max_size=3).map(
        lambda d: json.dumps(d, ensure_ascii=False)
    ),
    texts,
)


@st.composite
def tool_calls(draw: st.DrawFn) -> list[dict[str, Any]]:
    """1–3 OpenAI-shaped calls whose ids come in every form providers send."""
    calls = []
    for index in range(draw(st.integers(1, 3))):
        name = draw(tool_names)
        # The model's own form, a provider's, Kimi's without prefix, none, and one naming another tool.
        ids = (f"functions.{name}:{index}", f"call_{index}abc", f"{name}:{index}", None, "functions.other:9")
        call_id = draw(st.sampled_from(ids))
        calls.append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": draw(_arguments)}}
        )
    return calls


@st.composite
def answers_messages(draw: st.DrawFn) -> dict[str, Any]:
    """An OpenRouter ``choices[0]`` ``{"message": …, "finish_reason": …}`` of any shape."""
    message: dict[str, Any] = {"role": "assistant", "content": draw(optional_texts)}
    reasoning = draw(optional_texts)
    if draw(st.integers(0, 7)) == 0:
        message["content"] = draw(st.sampled_from((None, "")))
        reasoning = (reasoning or "") + draw(st.sampled_from(RAW_TOOL_TEXT))
    edges = draw(st.sampled_from(_KEPT_NEWLINES))
    if reasoning is not None and edges[0]:
        reasoning = edges[0] + reasoning + edges[0]
    if message["content"] is not None and edges[1]:
        message["content"] = edges[1] + message["content"]
    field = draw(st.sampled_from(("reasoning", "reasoning_content", "reasoning_details")))
    if field == "reasoning_details":
        if reasoning is not None:
            message["reasoning_details"] = [{"type": "reasoning.text", "text": reasoning}]
    else:
        message[field] = reasoning
    if draw(st.booleans()):
        message["tool_calls"] = draw(tool_calls())
    return {"message": message, "finish_reason": draw(st.sampled_from(FINISH_REASONS))}


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)``: optional system prompt, optional earlier tool-call round, a user turn."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(texts)})
    messages.append({"role": "user", "content": draw(texts)})
    if draw(st.booleans()):
        calls = draw(tool_calls())
        messages.append(
            {"role": "assistant", "content": draw(texts), "reasoning_content": draw(texts), "tool_calls": calls}
        )
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"] or "x", "content": draw(texts)})
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": draw(texts)})
            messages.append({"role": "user", "content": draw(texts)})
    tools = None
    if draw(st.booleans()):
        tools = [
            {"type": "function", "function": {"name": draw(tool_names), "description": draw(texts),
                                              "parameters": {"type": "object", "properties": {}}}}
        ]
    return messages, tools
