"""Response bodies and stream chunks in OpenRouter's JSON shapes (openrouter.md "Response")."""

from __future__ import annotations

import json
from typing import Any

from simulator.answers import Answer
from simulator.billing import BilledUsage
from simulator.engine_ids import EngineIds
from simulator.faults import error_body
from simulator.kimi import ToolCall, render_tool_calls
from simulator.tokens import TokenCounter, split_every

KEEPALIVE = b": OPENROUTER PROCESSING\n\n"
DONE = b"data: [DONE]\n\n"

# The 200-with-error seen in the wild: a provider's rate limit surfacing inside a 200.
ERROR200 = error_body(429, "Provider returned error", {"raw": "error code: 1015"})


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def tool_call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _reasoning_fields(answer: Answer, text: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if answer.reasoning_field in ("reasoning", "reasoning_content"):
        out[answer.reasoning_field] = text
    if text is not None and (answer.reasoning_field == "details" or answer.reasoning_details):
        out["reasoning_details"] = [
            {"type": "reasoning.text", "text": text, "signature": None, "format": "unknown",
             "index": 0}
        ]
    return out


def message_json(answer: Answer) -> dict[str, Any]:
    shown = answer.reasoning if answer.show_reasoning else None
    msg: dict[str, Any] = {"role": "assistant", "content": answer.visible_content, "refusal": None}
    msg.update(_reasoning_fields(answer, shown))
    if answer.tool_calls:
        msg["tool_calls"] = [tool_call_json(c, i) for i, c in enumerate(answer.tool_calls)]
    return msg


def _envelope(gen_id: str, created: int, model: str, provider: str, obj: str) -> dict[str, Any]:
    return {"id": gen_id, "provider": provider, "model": model, "object": obj,
            "created": created}


def completion_body(*, gen_id: str, created: int, model: str, provider: str, answer: Answer,
                    usage: BilledUsage, ids: EngineIds | None = None) -> dict[str, Any]:
    body = _envelope(gen_id, created, model, provider, "chat.completion")
    body["choices"] = [{
        "logprobs": None,
        "finish_reason": answer.finish_reason,
        "native_finish_reason": answer.native_finish_reason,
        "index": 0,
        "message": message_json(answer),
    }]
    if ids is not None and ids.shape == "sglang":  # SGLang's places: both in the choice
        body["choices"][0]["prompt_token_ids"] = ids.prompt_ids
        body["choices"][0]["token_ids"] = ids.token_ids
    elif ids is not None and ids.shape == "vllm":  # vLLM's: top-level prompt ids, the choice's sampled ids
        body["prompt_token_ids"] = ids.prompt_ids
        body["choices"][0]["token_ids"] = ids.token_ids
    body["usage"] = usage.to_json()
    return body


def error200_body(*, gen_id: str, created: int, model: str, provider: str) -> dict[str, Any]:
    """200 with null content, zero usage and an error object (openrouter.md "Errors")."""
    body = _envelope(gen_id, created, model, provider, "chat.completion")
    error = {**ERROR200["error"],
             "metadata": {**ERROR200["error"]["metadata"], "provider_name": provider}}
    body["choices"] = [{
        "logprobs": None, "finish_reason": "stop", "native_finish_reason": "stop", "index": 0,
        "message": {"role": "assistant", "content": None, "refusal": None},
        "error": error,
    }]
    body["usage"] = BilledUsage().to_json()
    body["error"] = error
    return body


def chunk(gen_id: str, created: int, model: str, provider: str, *,
          delta: dict[str, Any] | None = None, finish: str | None = None,
          native_finish: str | None = None) -> dict[str, Any]:
    body = _envelope(gen_id, created, model, provider, "chat.completion.chunk")
    body["choices"] = [{
        "index": 0,
        "delta": delta if delta is not None else {"role": "assistant", "content": ""},
        "finish_reason": finish,
        "native_finish_reason": native_finish,
        "logprobs": None,
    }]
    return body


def stream_deltas(answer: Answer, tokens_per_chunk: int,
                  counter: TokenCounter) -> list[tuple[dict[str, Any] | None, int]]:
    """Deltas in emission order, each with the completion tokens it stands for (for pacing and
    for billing a stream cut short). Hidden reasoning still takes time and tokens: its delta is
    None, sent as nothing."""
    out: list[tuple[dict[str, Any] | None, int]] = []
    if answer.reasoning:
        for piece in split_every(answer.reasoning, tokens_per_chunk):
            delta: dict[str, Any] | None = None
            if answer.show_reasoning:
                delta = {"role": "assistant", "content": "", **_reasoning_fields(answer, piece)}
            out.append((delta, counter.count(piece)))
    content = answer.visible_content
    if content:
        for piece in split_every(content, tokens_per_chunk):
            out.append(({"role": "assistant", "content": piece}, counter.count(piece)))
    for i, call in enumerate(answer.tool_calls):
        delta = {"role": "assistant", "content": None, "tool_calls": [tool_call_json(call, i)]}
        out.append((delta, counter.count(render_tool_calls([call]))))
    return out
