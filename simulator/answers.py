"""What the simulated model answers to a request: reasoning, content, tool calls, finish reason.

Pure and deterministic: the same (seed, messages, tools, max_tokens, settings) gives the same answer
in any process, and a retry of a prompt gets the answer its first attempt would have had.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simulator.kimi import (
    IM_END,
    THINK_END,
    ToolCall,
    calls_in_message,
    message_text,
    render_tool_calls,
)
from simulator.request import ChatRequest
from simulator.script import Script
from simulator.seeding import rng_for
from simulator.settings import DEGENERATE_KINDS, LEAK_IM_END, LengthDistribution, SimSettings
from simulator.text import generate_text, schema_value
from simulator.tokens import TokenCounter

#: How much an effort level scales the reasoning length ("none" disables reasoning).
EFFORT_SCALE = {"xhigh": 2.0, "high": 1.5, "medium": 1.0, "low": 0.5, "minimal": 0.25}

RAW_TOOL_LEAD_RATE = 0.3  # raw tool-call text sometimes follows a sentence, as Kimi does


@dataclass(frozen=True)
class Answer:
    reasoning: str | None  # what the model reasoned (billed even when not shown)
    content: str | None  # without any leaked <|im_end|>
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    native_finish_reason: str
    show_reasoning: bool
    reasoning_field: str
    reasoning_details: bool
    leak_im_end: bool

    @property
    def visible_content(self) -> str | None:
        if self.content is not None and self.leak_im_end:
            return self.content + IM_END
        return self.content

    def completion_parts(self) -> list[str]:
        """The generated token text in order (``reasoning</think>content…<|im_end|>``), as the
        client rebuilds it; usage counts these."""
        parts: list[str] = []
        rest = self.content is not None or bool(self.tool_calls)
        if self.reasoning is not None:
            parts.append(self.reasoning)
            if rest:
                parts.append(THINK_END)
        if self.content:
            parts.append(self.content)
        if self.tool_calls:
            parts.append(render_tool_calls(self.tool_calls))
        if self.finish_reason in ("stop", "tool_calls"):
            parts.append(IM_END)
        return parts


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: Any


def length_class(classes: Mapping[str, LengthDistribution], max_tokens: int | None) -> LengthDistribution:
    ordered = sorted(classes.values(), key=lambda c: c.min_max_tokens)
    if max_tokens is None:
        return ordered[-1]
    fitting = [c for c in ordered if c.min_max_tokens <= max_tokens]
    return fitting[-1] if fitting else ordered[0]


def build_answer(
    req: ChatRequest, settings: SimSettings, script: Script | None, counter: TokenCounter
) -> Answer:
    given = script.given if script else frozenset()
    klass = length_class(settings.length_classes, req.max_tokens)
    budget = req.max_tokens
    reasoning: str | None = None
    if req.reasoning.enabled:
        if script and "reasoning" in given:
            reasoning = script.reasoning
        else:
            scale = EFFORT_SCALE.get(req.reasoning.effort or "medium", 1.0)
            rng = rng_for(settings.seed, req.prompt_hash, "reasoning")
            n = _draw(rng, klass.reasoning_mean * scale, klass.reasoning_sd * scale)
            reasoning = _text(rng, n, counter)
            if req.reasoning.max_tokens is not None:
                reasoning = counter.truncate(reasoning, req.reasoning.max_tokens)
            if budget is not None and counter.count(reasoning) >= budget:
                # Reasoning ate max_tokens: no </think>, no content, finish "length".
                return _answer(req, settings, script, counter.truncate(reasoning, budget),
                               None, (), "length")
    left = budget
    if budget is not None and reasoning is not None:
        left = budget - counter.count(reasoning) - 1  # the </think>
    if script and given & {"content", "tool_calls"}:
        content, calls, finish = _scripted_shape(req, script)
    elif kind := degenerate_kind(settings, req):
        return _degenerate(req, settings, script, counter, kind, reasoning, left, klass)
    else:
        content, calls, finish = _generated_shape(req, settings, counter, left, klass)
    return _answer(req, settings, script, reasoning, content, calls, finish)


def degenerate_kind(settings: SimSettings, req: ChatRequest) -> str | None:
    """The degenerate kind this prompt's answer takes (``rates.degenerate_*``), seeded per prompt:
    every attempt of a prompt the same."""
    rates = [(k, settings.rates.get(k, 0.0)) for k in DEGENERATE_KINDS]
    if not any(r for _, r in rates):
        return None
    draw = rng_for(settings.seed, req.prompt_hash, "degenerate").random()
    acc = 0.0
    for kind, rate in rates:
        acc += rate
        if draw < acc:
            return kind
    return None


#: Sentences of a looping answer: what the repeated n-gram is made of.
REPEAT_PIECES = 12


def _degenerate(
    req: ChatRequest, settings: SimSettings, script: Script | None, counter: TokenCounter, kind: str,
    reasoning: str | None, left: int | None, klass: LengthDistribution,
) -> Answer:
    rng = rng_for(settings.seed, req.prompt_hash, "content")
    if kind == "degenerate_repeat":
        # One sentence again and again, as a looping reasoning model answers, to about the answer's length.
        sentence = generate_text(rng, REPEAT_PIECES).strip() + " "
        times = max(6, round(_draw(rng, klass.content_mean, klass.content_sd) / REPEAT_PIECES))
        content, calls, finish = _fit((sentence * times).strip(), left, counter)
        return _answer(req, settings, script, reasoning, content, calls, finish)
    if reasoning is None:  # the kinds below are reasoning's: a model asked not to reason still did
        reasoning = _text(rng, max(8, round(klass.reasoning_mean)), counter)
    if kind == "degenerate_empty":  # reasoning closed, then nothing
        return _answer(req, settings, script, reasoning, "", (), "stop")
    # The turn ends inside the reasoning: no think-close, content null.
    return _answer(req, settings, script, reasoning, None, (), "stop")


def _answer(
    req: ChatRequest, settings: SimSettings, script: Script | None, reasoning: str | None,
    content: str | None, calls: tuple[ToolCall, ...], finish: str,
) -> Answer:
    given = script.given if script else frozenset()
    if script and script.finish_reason:
        finish = script.finish_reason
    if script and "leak_im_end" in given:
        leak = script.leak_im_end
    else:
        rng = rng_for(settings.seed, req.prompt_hash, "leak")
        leak = rng.random() < settings.rates.get(LEAK_IM_END, 0.0)
    return Answer(
        reasoning=reasoning,
        content=content,
        tool_calls=calls,
        finish_reason=finish,
        native_finish_reason=(script.native_finish_reason if script else None) or finish,
        show_reasoning=not req.reasoning.exclude,
        reasoning_field=(script.reasoning_field if script else None) or settings.reasoning_field,
        reasoning_details=settings.reasoning_details,
        leak_im_end=leak and finish == "stop" and content is not None,
    )


_Shape = tuple[str | None, tuple[ToolCall, ...], str]  # content, tool calls, finish reason


def _scripted_shape(req: ChatRequest, script: Script) -> _Shape:
    first = prior_call_count(req.messages)
    calls = tuple(
        ToolCall(id=c.id or f"functions.{c.name}:{first + i}", name=c.name, arguments=c.arguments)
        for i, c in enumerate(script.tool_calls)
    )
    content = script.content
    if script.raw_tool_text and calls:
        return (content or "") + render_tool_calls(calls), (), "stop"
    return content, calls, "tool_calls" if calls else "stop"


def _generated_shape(
    req: ChatRequest, settings: SimSettings, counter: TokenCounter, left: int | None,
    klass: LengthDistribution,
) -> _Shape:
    rng = rng_for(settings.seed, req.prompt_hash, "shape")
    text_rng = rng_for(settings.seed, req.prompt_hash, "content")
    first = prior_call_count(req.messages)
    if req.tools and req.tool_choice != "none":
        forced = _forced_name(req.tool_choice)
        if forced or req.tool_choice == "required" or rng.random() < settings.tool_call_rate:
            specs = [s for s in tool_specs(req.tools) if forced is None or s.name == forced]
            calls = make_calls(rng, specs or tool_specs(req.tools), first, single=bool(forced))
            content = None if rng.random() < settings.null_content_rate else ""
            if left is None or counter.count(render_tool_calls(calls)) + 1 <= left:
                return content, calls, "tool_calls"
            return None, (), "length"  # the call section did not fit in max_tokens
    elif not req.tools:
        declared = declared_tools(req.messages)
        if declared and rng.random() < settings.raw_tool_text_rate:
            section = render_tool_calls(make_calls(rng, declared, first, single=False))
            lead = ""
            if rng.random() < RAW_TOOL_LEAD_RATE:
                lead = generate_text(text_rng, text_rng.randint(4, 12)) + "\n"
            return _fit(lead + section, left, counter)
    n = _draw(text_rng, klass.content_mean, klass.content_sd)
    return _fit(_text(text_rng, n, counter), left, counter)


def _fit(text: str, left: int | None, counter: TokenCounter) -> _Shape:
    """Content cut to what max_tokens leaves; the +1 is the end-of-turn token."""
    if left is None or counter.count(text) + 1 <= left:
        return text, (), "stop"
    return counter.truncate(text, left) or None, (), "length"


def _text(rng: random.Random, n_tokens: int, counter: TokenCounter) -> str:
    """About ``n_tokens`` of the counter's tokens (exactly, with the simple rule)."""
    pieces = max(1, round(n_tokens / counter.tokens_per_piece))
    text = generate_text(rng, pieces)
    counter.remember(text, pieces)
    return text


def _draw(rng: random.Random, mean: float, sd: float) -> int:
    """A length with this mean and standard deviation, lognormal: always positive and skewed
    right like real answer lengths (a clipped normal piles a few percent onto 1 token)."""
    if mean <= 0:
        return 1
    sigma2 = math.log1p((sd / mean) ** 2)
    mu = math.log(mean) - sigma2 / 2
    return max(1, round(math.exp(rng.gauss(mu, math.sqrt(sigma2)))))


def _forced_name(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            return str(fn["name"])
    return None


def prior_call_count(messages: Sequence[Mapping[str, Any]]) -> int:
    """Kimi numbers tool calls across the whole conversation: ``functions.x:{idx}``."""
    return sum(len(calls_in_message(m)) for m in messages if m.get("role") == "assistant")


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    return [ToolSpec(t["function"]["name"], t["function"].get("parameters")) for t in tools]


def make_calls(
    rng: random.Random, specs: Sequence[ToolSpec], first_idx: int, *, single: bool
) -> tuple[ToolCall, ...]:
    # Parallel calls happen, but one call is the common case.
    n = 2 if not single and len(specs) > 1 and rng.random() < 0.2 else 1
    calls = []
    for i in range(n):
        spec = rng.choice(list(specs))
        args = schema_value(spec.parameters or {"type": "object"}, rng)
        calls.append(ToolCall(
            id=f"functions.{spec.name}:{first_idx + i}",
            name=spec.name,
            arguments=json.dumps(args, ensure_ascii=False),
        ))
    return tuple(calls)


_NAMED = re.compile(r"functions\.([A-Za-z_][\w-]*)")
_MAX_JSON_TRIES = 64  # bounds the scan of a long system prompt


def declared_tools(messages: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    """Tools a system message declares in text (JSON tool schemas, or ``functions.name``), which
    is when a provider without ``tools`` support emits raw tool-call tokens."""
    found: dict[str, ToolSpec] = {}
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            continue
        text = message_text(m.get("content"))
        lowered = text.lower()
        if "tool" not in lowered and "function" not in lowered:
            continue
        specs = _json_tools(text) or [ToolSpec(n, None) for n in _NAMED.findall(text)]
        for spec in specs:
            found.setdefault(spec.name, spec)
    return list(found.values())


def _json_tools(text: str) -> list[ToolSpec]:
    decoder = json.JSONDecoder()
    specs: list[ToolSpec] = []
    pos = 0
    for _ in range(_MAX_JSON_TRIES):
        starts = [i for i in (text.find("[", pos), text.find("{", pos)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, pos = decoder.raw_decode(text, start)
        except ValueError:
            pos = start + 1
            continue
        _collect(value, specs)
    return specs


def _collect(value: Any, specs: list[ToolSpec]) -> None:
    if isinstance(value, list):
        for item in value:
            _collect(item, specs)
    elif isinstance(value, dict):
        fn = value.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            specs.append(ToolSpec(fn["name"], fn.get("parameters")))
        elif isinstance(value.get("name"), str) and {"parameters", "description"} & value.keys():
            specs.append(ToolSpec(value["name"], value.get("parameters")))
