"""The pure part of answering: request → answer + usage, and the latency draw.

``predict`` runs it without a server, so a test can know the exact message the simulator will
send for a prompt (no fault hitting) before sending it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from simulator.answers import Answer, build_answer
from simulator.billing import BilledUsage, priced, with_overrides
from simulator.engine_ids import EngineIds, EngineIdsError, EngineTokenizer, engine_ids
from simulator.kimi import THINK, THINK_END, render_prompt
from simulator.request import ChatRequest, parse_chat_request
from simulator.script import Script, find_script
from simulator.seeding import rng_for
from simulator.settings import SimSettings
from simulator.tokens import SimpleCounter, TokenCounter
from simulator.wire import message_json

_Z99 = 2.3263478740408408  # standard normal quantile at 0.99: sigma = ln(p99/median) / z


@dataclass(frozen=True)
class Generation:
    answer: Answer
    usage: BilledUsage
    ids: EngineIds | None = None  # with return_token_ids (engine_ids.py)


_ENGINE_TOKENIZERS: dict[str, EngineTokenizer] = {}


def engine_tokenizer(counter: TokenCounter) -> EngineTokenizer:
    """The counter's tokenizer as the engine's (one per tokenizer path and process: its chat
    template loads once)."""
    backend, path = getattr(counter, "backend", None), getattr(counter, "path", None)
    if backend is None or path is None:
        raise EngineIdsError("return_token_ids: this simulator has no tokenizer to give ids "
                             "with; start it with --tokenizer DIR")
    tok = _ENGINE_TOKENIZERS.get(path)
    if tok is None:
        tok = _ENGINE_TOKENIZERS[path] = EngineTokenizer(backend, path)
    return tok


def _engine_ids(req: ChatRequest, settings: SimSettings, script: Script | None,
                counter: TokenCounter, answer: Answer) -> EngineIds:
    if script is not None and "noncanonical" in script.given:
        inject = script.noncanonical
    else:
        inject = rng_for(settings.seed, req.prompt_hash, "noncanonical").random() \
            < settings.noncanonical_rate
    ids = engine_ids(engine_tokenizer(counter), req.messages, req.tools, answer, inject=inject,
                     rng=rng_for(settings.seed, req.prompt_hash, "split"))
    if script is not None and script.ids_shape is not None:
        ids = replace(ids, shape=script.ids_shape)
    return ids


def _template_counts(req: ChatRequest, counter: TokenCounter, answer: Answer) -> tuple[int, int] | None:
    """With a tokenizer that has a chat template, usage counts what a provider's engine counts: the
    template-rendered prompt's ids and the completion's, ``engine_ids``' (the think marker the
    prompt did not open or close, the end-of-turn token when the turn ended), so a client tokenizing
    with the same files counts the same (common/usage_check.py). The completion is counted part by
    part, as before (its parts meet at special tokens, which a tokenizer splits on before anything
    else, so the sum is the whole's count; each text's count is cached): encoding the joined turn
    instead cost ~2.5 ms more an answer. None: the simple rule, or no chat template (counted on the
    simulator's own render)."""
    if getattr(counter, "backend", None) is None:
        return None
    try:
        prompt_text = engine_tokenizer(counter).render_prompt(req.messages, req.tools)
    except EngineIdsError:
        return None
    parts = answer.completion_parts()
    if answer.reasoning is None:
        lead = [THINK_END] if prompt_text.endswith(THINK) and any(parts) else []
    else:
        lead = [] if prompt_text.endswith(THINK) else [THINK]
    return counter.count(prompt_text), sum(counter.count(p) for p in [*lead, *parts])


def _usage_skew(req: ChatRequest, settings: SimSettings, script: Script | None) -> int:
    """The usage fault: ``usage_skew_tokens`` more completion tokens billed than generated, on a
    seeded ``usage_skew_rate`` share of prompts (or where a ``#sim`` ``usage_skew`` says), as a
    provider counting with another tokenizer would."""
    if script is not None and "usage_skew" in script.given:
        return script.usage_skew
    if settings.usage_skew_rate <= 0:
        return 0
    hit = rng_for(settings.seed, req.prompt_hash, "usage_skew").random() < settings.usage_skew_rate
    return settings.usage_skew_tokens if hit else 0


def generate(req: ChatRequest, settings: SimSettings, script: Script | None,
             counter: TokenCounter, *, attempt: int = 1) -> Generation:
    """The answer and its usage; with ``return_token_ids`` also the engine's ids, and then usage
    counts them, as vLLM does (prompt ids, completion ids with the end-of-turn token)."""
    answer = build_answer(req, settings, script, counter)
    ids = _engine_ids(req, settings, script, counter, answer) if req.return_token_ids else None
    counted = _template_counts(req, counter, answer) if ids is None else None
    if ids is not None:
        prompt, completion = len(ids.prompt_ids), len(ids.token_ids)
        reasoning = ids.reasoning_tokens
    else:
        prompt, completion = counted or (counter.count(render_prompt(req.messages, req.tools)),
                                         sum(counter.count(p) for p in answer.completion_parts()))
        reasoning = counter.count(answer.reasoning) if answer.reasoning else 0
    completion += _usage_skew(req, settings, script)
    # A repeat of the same prompt may hit the provider's prefix cache.
    cached = int(prompt * settings.cached_fraction) if attempt > 1 else 0
    prices = settings.prices()
    usage = priced(prompt, completion, reasoning, cached, **prices)
    if script is not None:
        usage = with_overrides(usage, script.usage, **prices)
    return Generation(answer, usage, ids)


def base_latency_ms(rng: random.Random, settings: SimSettings) -> float:
    """Time to first token: lognormal with the configured median and p99."""
    median = settings.latency_median_ms
    if median <= 0:
        return 0.0
    sigma = math.log(max(settings.p99_ms, median) / median) / _Z99
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def predict(body: Mapping[str, Any], settings: SimSettings | None = None,
            counter: TokenCounter | None = None, *, attempt: int = 1) -> dict[str, Any]:
    """What the server answers to ``body`` when no fault hits:
    ``{"message", "finish_reason", "native_finish_reason", "usage"}``, plus ``prompt_token_ids``,
    ``token_ids`` and ``noncanonical`` (the injection or None) with ``return_token_ids``."""
    settings = settings or SimSettings()
    counter = counter or SimpleCounter()
    req = parse_chat_request(json.dumps(body).encode(), default_model=settings.model)
    gen = generate(req, settings, find_script(req.messages), counter, attempt=attempt)
    out: dict[str, Any] = {
        "message": message_json(gen.answer),
        "finish_reason": gen.answer.finish_reason,
        "native_finish_reason": gen.answer.native_finish_reason,
        "usage": gen.usage.to_json(),
    }
    if gen.ids is not None:
        out.update(prompt_token_ids=gen.ids.prompt_ids, token_ids=gen.ids.token_ids,
                   noncanonical=gen.ids.injection.to_json() if gen.ids.injection else None)
    return out
