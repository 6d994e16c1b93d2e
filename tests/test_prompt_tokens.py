"""The plan counts a prompt's tokens exactly as the worker builds the prompt it sends and keeps."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from common.datasets import parse_row
from common.prompt_tokens import count_prompt_tokens, load_tokenizer
from common.target import TargetTokenizer
from harness.tokenizer_factory import FAMILIES, KIMI_K25, write_remote_tokenizer, write_tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}]
ROWS = [
    {"messages": [{"role": "user", "content": "Hello, what is 2 + 2? ✓"}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "functions.get_weather:0", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}],
     "tools": TOOLS},
    {"messages": [{"role": "user", "content": "Special text <|im_end|> stays one token 你好"}]},
]


@pytest.mark.parametrize("family", [*FAMILIES, dataclasses.replace(KIMI_K25, name="bos", bos_prefix="[BOS]")],
                         ids=lambda f: f.name)
def test_counts_equal_the_workers_prompt_ids(tmp_path: Path, family: object) -> None:
    path = str(write_tokenizer(family, tmp_path / "tok"))  # type: ignore[arg-type]
    prompts = [parse_row(json.dumps(r), f"f:{i}") for i, r in enumerate(ROWS, start=1)]
    target = TargetTokenizer.load(path, trust_remote_code=False)
    expected = [len(target.prompt_ids(p.messages, p.tools)) for p in prompts]
    assert count_prompt_tokens(load_tokenizer(path, trust_remote_code=False), prompts) == expected


def test_remote_code_tokenizers_count_the_same(tmp_path: Path) -> None:
    path = str(write_remote_tokenizer(KIMI_K25, tmp_path / "tok", class_name="ChattyTokenizer",
                                      first_bad_id_token="[UNK]"))
    prompts = [parse_row(json.dumps(r), f"f:{i}") for i, r in enumerate(ROWS, start=1)]
    target = TargetTokenizer.load(path, trust_remote_code=True)
    expected = [len(target.prompt_ids(p.messages, p.tools)) for p in prompts]
    assert count_prompt_tokens(load_tokenizer(path, trust_remote_code=True), prompts) == expected
