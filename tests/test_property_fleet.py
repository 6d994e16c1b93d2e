"""Property, end to end: random answers, scripted into the simulator with ``#sim``, go through a real
worker (HTTP client, rebuild, self-check, Redis, collector) and every row written is token-exact.

One fleet (simulator + one ``celery worker`` on the demo tokenizer, Kimi-K2.5-like) serves the whole
test; each hypothesis example is a batch of answers run by the producer as a fresh dataset. Answers
come from ``tests/strategies.py``: texts with every special-token string, near-misses, emoji, ""
and None, structured tool calls (``tools`` in the row) or the same calls as raw Kimi tool-call text
in ``content`` (no ``tools``), leaked ``<|im_end|>``, reasoning in each of the three fields.

Each row is checked here, independently of ``common/rebuild.py``, with the demo tokenizer loaded
through ``transformers.AutoTokenizer``: the prompt part is the chat template with the generation
prompt; the completion is exactly the text the Kimi K2.5 turn layout gives for the answer the
simulator sent, encoded as one piece (so every special-token string is its single id); it ends
with ``<|im_end|>`` iff ``finish_reason`` is stop/tool_calls; ``sum(loss_mask) == num_tokens``.

Left out, because the worker rightly does not keep them as rows: ``content_filter`` answers (a
fatal upstream error) and answers with nothing in them (no content, reasoning or tool calls: the
client retries them as ``empty_answer``).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tests.fleet import DEMO_TOKENIZER, Fleet, read_summary, write_jsonl
from tests.strategies import answers_messages, conversations

pytestmark = pytest.mark.fleet

BATCH = 25
EXAMPLES = 10

# The demo tokenizer's turn layout (Kimi K2.5), written out from the rules rather than read
# from the worker's derived ``TurnFormat``: the generation prompt ends with <think>, so the model
# emits ``reasoning</think>content<tool-call section><|im_end|>``.
THINK_CLOSE = "</think>"
END = "<|im_end|>"
EOS = "[EOS]"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_ID = re.compile(r"functions\.(?P<name>.+):(?P<index>\d+)", re.DOTALL)


# --- the cases: a conversation, a #sim script, the tools the row sends ----------------------------


def _reasoning_of(message: dict[str, Any]) -> tuple[str | None, str]:
    """(reasoning, #sim reasoning_field) of a drawn answer message."""
    if "reasoning_details" in message:
        return message["reasoning_details"][0]["text"], "details"
    for field in ("reasoning_content", "reasoning"):
        if field in message:
            return message[field], field
    return None, "details"  # no reasoning at all: "details" sends no reasoning key


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    messages, tools = draw(conversations())
    choice = draw(answers_messages())
    message, finish = choice["message"], choice["finish_reason"]
    reasoning, field = _reasoning_of(message)
    spec: dict[str, Any] = {
        "reasoning": reasoning,
        "content": message["content"],
        "finish_reason": finish,
        "reasoning_field": field,
        "leak_im_end": draw(st.booleans()),
    }
    calls = message.get("tool_calls") or []
    raw = bool(calls) and draw(st.booleans())
    if calls:
        spec["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"],
             **({"id": c["id"]} if c["id"] is not None else {})}
            for c in calls
        ]
    if raw:
        spec["raw_tool_text"] = True
        tools = None  # raw tool-call text is what a provider sends when no tools were given
    elif calls:
        declared = {t["function"]["name"] for t in tools or []}
        tools = list(tools or []) + [
            {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
            for name in dict.fromkeys(c["function"]["name"] for c in calls) if name not in declared
        ]
    return {"messages": messages, "tools": tools, "spec": spec}


def _with_script(messages: list[dict[str, Any]], spec: dict[str, Any], tag: str) -> list[dict[str, Any]]:
    """The conversation with ``#sim {spec}`` leading its last user message (where the simulator
    reads it). Raw JSON: the special-token strings in the script reach the prompt too."""
    out = [dict(m) for m in messages]
    last_user = max(i for i, m in enumerate(out) if m["role"] == "user")
    out[last_user]["content"] = f"#sim {json.dumps(spec, ensure_ascii=False)} {tag} {out[last_user]['content']}"
    return out


def _earlier_calls(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("tool_calls") or []) for m in messages if m["role"] == "assistant")


def sent_answer(spec: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """What the simulator answers to the script, per the ``#sim`` format in ``simulator/__init__``:
    ``{reasoning, content, tool_calls, finish}`` as the worker reads them off the message."""
    first = _earlier_calls(messages)
    calls = [{"id": c.get("id") or f"functions.{c['name']}:{first + i}", "name": c["name"],
              "arguments": c["arguments"]} for i, c in enumerate(spec.get("tool_calls", []))]
    content, finish = spec["content"], spec["finish_reason"]
    if spec.get("raw_tool_text") and calls:
        content, calls = (content or "") + _section(calls), []
    if spec["leak_im_end"] and finish == "stop" and content is not None:
        content += END
    return {"reasoning": spec["reasoning"], "content": content, "tool_calls": calls, "finish": finish}


def kept_by_worker(spec: dict[str, Any], sent: dict[str, Any]) -> bool:
    """Answers the worker takes at all: not filtered, and something in the message."""
    if sent["finish"] == "content_filter":
        return False
    shown_reasoning = sent["reasoning"] is not None if spec["reasoning_field"] == "details" else sent["reasoning"]
    return bool(sent["content"] or shown_reasoning or sent["tool_calls"])


# --- the expected completion, from the rules for a Kimi K2.5 turn -------------------------


def _section(calls: list[dict[str, Any]]) -> str:
    body = "".join(f"{CALL_BEGIN}{c['id']}{ARG_BEGIN}{c['arguments']}{CALL_END}" for c in calls)
    return f"{SECTION_BEGIN}{body}{SECTION_END}"


def _strip_ends(text: str | None) -> str | None:
    while text is not None and text.endswith((END, EOS)):
        text = text[: -len(END)] if text.endswith(END) else text[: -len(EOS)]
    return text


def expected_completion(sent: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The completion the model emitted for ``sent``: ``text``, the ``reasoning`` and (normalised)
    ``calls`` the kept assistant message carries, ``implicit`` (a tool-call section opened inside
    the reasoning) and ``ended`` (the turn ends with ``<|im_end|>``)."""
    ended = sent["finish"] in ("stop", "tool_calls")
    reasoning, content = sent["reasoning"], _strip_ends(sent["content"])
    first = _earlier_calls(messages)
    calls = []
    for i, c in enumerate(sent["tool_calls"]):
        match = KIMI_ID.fullmatch(c["id"])  # ids the model cannot have emitted get its own form
        call_id = c["id"] if match and match["name"] == c["name"] else f"functions.{c['name']}:{first + i}"
        calls.append({**c, "id": call_id})
    implicit = bool(reasoning) and not content and SECTION_BEGIN in reasoning
    if implicit:
        # The tool-call section opened inside the reasoning: no </think> was emitted. That raw text is
        # the token stream; structured calls sent beside it (rare) are its parse, not more tokens.
        at = reasoning.index(SECTION_BEGIN)
        text = reasoning[:at] + (_strip_ends(reasoning[at:]) or "")
        reasoning = reasoning[:at]
    else:
        if reasoning and not content and not calls:
            reasoning = _strip_ends(reasoning)
        if not content and not calls and not ended:
            text = reasoning or ""  # cut off while still reasoning
        else:
            text = (reasoning or "") + THINK_CLOSE + (content or "") + (_section(calls) if calls else "")
    if ended:
        text += END
    return {"text": text, "reasoning": reasoning, "implicit": implicit, "calls": calls, "ended": ended}


# --- checking one row -----------------------------------------------------------------------------


class Checker:
    def __init__(self) -> None:
        self.tok = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
        specials = sorted(self.tok.get_added_vocab(), key=len, reverse=True)
        self.special_ids = {self.tok.convert_tokens_to_ids(s): s for s in specials}
        self.special_re = re.compile("|".join(map(re.escape, specials)))
        self.end_id = self.tok.convert_tokens_to_ids(END)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, gen: bool) -> str:
        return str(self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen))

    def problems(self, row: dict[str, Any], case: dict[str, Any]) -> list[str]:
        messages, tools = case["messages"], case["tools"]
        want = case["expected"]
        ids, mask = row["input_ids"], row["loss_mask"]
        out: list[str] = []
        prompt_text = self.render(messages, tools, gen=True)
        prompt_ids = self.encode(prompt_text)
        n_prompt = len(prompt_ids)
        if len(ids) != len(mask) or mask != [0] * n_prompt + [1] * (len(ids) - n_prompt):
            out.append(f"loss_mask is not 0×{n_prompt} then 1s")
        if ids[:n_prompt] != prompt_ids:
            out.append("prompt ids differ from the chat template with the generation prompt")
        if sum(mask) != row["num_tokens"]:
            out.append(f"sum(loss_mask)={sum(mask)} but num_tokens={row['num_tokens']}")
        completion = ids[n_prompt:]
        decoded = self.tok.decode(completion, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if decoded != want["text"]:
            out.append(f"completion decodes to {decoded!r}, expected {want['text']!r}")
        if completion != self.encode(want["text"]):
            out.append("completion ids are not the expected text encoded")
        got_specials = [self.special_ids[i] for i in completion if i in self.special_ids]
        text_specials = [m.group() for m in self.special_re.finditer(want["text"])]
        if got_specials != text_specials:
            out.append(f"special ids {got_specials} != special strings in the text {text_specials}")
        if (bool(completion) and completion[-1] == self.end_id) != want["ended"]:
            out.append(f"ends with <|im_end|>: {not want['ended']}, finish_reason {case['sent']['finish']}")
        if row["finish_reason"] != case["sent"]["finish"]:
            out.append(f"finish_reason {row['finish_reason']!r}")
        if row["conversations"][:-1] != messages or (row.get("tools") or None) != tools:
            out.append("conversations/tools of the row are not the prompt's")
        assistant = row["conversations"][-1]
        if assistant.get("reasoning_content") != want["reasoning"]:
            out.append(f"reasoning_content {assistant.get('reasoning_content')!r}, expected {want['reasoning']!r}")
        if [c["id"] for c in assistant.get("tool_calls") or []] != [c["id"] for c in want["calls"]]:
            out.append(f"tool call ids {assistant.get('tool_calls')!r}")
        # The template renders the kept message as the same turn, where it keeps this turn's
        # reasoning: with tool calls (the turn stays in its suffix), or with no reasoning to lose.
        if want["ended"] and not want["implicit"] and (want["calls"] or not want["reasoning"]):
            full = self.render(row["conversations"], tools, gen=False)
            if not (full == prompt_text + want["text"] or
                    (not want["calls"] and full.endswith(prompt_text[prompt_text.rindex("<|im_assistant|>"):]
                                                         + want["text"]))):
                out.append(f"template renders the conversation as …{full[-200:]!r}")
        return out


# --- the test -------------------------------------------------------------------------------------


def test_random_answers_through_simulator_and_worker_are_token_exact(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.start_simulator("--latency-median-ms", "5")
    fleet.start_worker("w1", concurrency=BATCH)
    checker = Checker()
    counter = itertools.count()
    shapes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate),  # a shrink would re-run the fleet hundreds of times
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(batch=st.lists(cases(), min_size=BATCH, max_size=BATCH))
    def run_batch(batch: list[dict[str, Any]]) -> None:
        n = next(counter)
        dataset = f"prop{n:02d}"
        rows_in: list[dict[str, Any] | str] = []
        by_id: dict[str, dict[str, Any]] = {}
        for i, case in enumerate(batch):
            case["sent"] = sent_answer(case["spec"], case["messages"])
            if not kept_by_worker(case["spec"], case["sent"]):
                continue
            pid = f"{dataset}-{i:03d}"
            case["messages"] = _with_script(case["messages"], case["spec"], pid)
            case["expected"] = expected_completion(case["sent"], case["messages"])
            by_id[pid] = case
            rows_in.append({"id": pid, "messages": case["messages"], **({"tools": case["tools"]} if case["tools"]
                                                                         else {})})
            for shape in _shapes(case):
                shapes[shape] = shapes.get(shape, 0) + 1
        data = write_jsonl(fleet.tmp / f"{dataset}.jsonl", rows_in)
        config = fleet.write_config([{"name": dataset, "path": data, "length": "short",
                                      "budget_tokens": 1_000_000_000}], timeout_s=20)
        fleet.run_producer(config, timeout_s=60, name=f"producer-{dataset}")

        failed = _jsonl_lines(fleet.out / dataset / "failed.jsonl")
        assert not failed, "failed rows:\n" + "\n".join(
            f"{line}\n  script: {json.dumps(by_id[json.loads(line)['id']]['spec'], ensure_ascii=False)}"
            for line in failed)
        mismatches = int(redis_client.hget(f"specfleet:ds:{dataset}:stats", "fail:token_mismatch") or 0)
        assert mismatches == 0
        rows: dict[str, dict[str, Any]] = {}
        for shard in sorted((fleet.out / dataset).glob("shard-*.jsonl")):
            rows.update((r["id"], r) for r in map(json.loads, _jsonl_lines(shard)))
        summary = read_summary(fleet.out, dataset)
        assert sorted(rows) == sorted(by_id), f"kept {len(rows)} of {len(by_id)} prompts: {summary}"
        assert summary["results"] == len(by_id) and summary["failed"] == summary["skipped"] == 0
        bad = {pid: p for pid, row in rows.items() if (p := checker.problems(row, by_id[pid]))}
        assert not bad, "\n".join(
            f"{pid}: {'; '.join(p)}\n  script: {json.dumps(by_id[pid]['spec'], ensure_ascii=False)}"
            for pid, p in bad.items())

    run_batch()
    # The batches did reach the shapes the property is about (fixed seed: this is deterministic).
    for shape in ("tool_calls", "raw_tool_text", "implicit_end", "leaked_end", "length", "special_in_text",
                  "reasoning_details", "reasoning_none"):
        assert shapes.get(shape, 0) > 0, f"no {shape} answer drawn: {shapes}"


def _jsonl_lines(path: Path) -> list[str]:
    """Lines split on "\\n" only: rows written with ``ensure_ascii=False`` keep U+0085, U+2028 and the
    like raw inside strings, where ``str.splitlines`` (``tests.fleet.read_rows``) would cut them."""
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _shapes(case: dict[str, Any]) -> list[str]:
    sent, want, spec = case["sent"], case["expected"], case["spec"]
    out = []
    if sent["tool_calls"]:
        out.append("tool_calls")
    if spec.get("raw_tool_text") and spec.get("tool_calls"):
        out.append("raw_tool_text")
    if want["implicit"]:
        out.append("implicit_end")
    if sent["content"] and sent["content"].endswith(END):
        out.append("leaked_end")
    if sent["finish"] == "length":
        out.append("length")
    texts = (sent["content"] or "") + (sent["reasoning"] or "")
    if any(s in texts for s in ("<|im_end|>", "<think>", "<|im_start|>", "[EOS]")):
        out.append("special_in_text")
    if spec["reasoning_field"] == "details" and sent["reasoning"] is not None:
        out.append("reasoning_details")
    if sent["reasoning"] is None:
        out.append("reasoning_none")
    return out
