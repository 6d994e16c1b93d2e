"""Counting a prompt's tokens with the target tokenizer, as the model will see it.

The count is of the chat template rendered with the generation prompt (and the tools), tokenized
without adding BOS/EOS: what ``apply_chat_template(..., add_generation_prompt=True,
tokenize=True)`` returns and what a provider bills as prompt tokens. Fast tokenizers render a batch
and tokenize it in one Rust call; others (remote-code ones such as Kimi's tiktoken) go through
``apply_chat_template`` itself, prompt by prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from common.datasets import Prompt
from common.errors import ConfigError
from common.hf import auto_tokenizer

#: Tokens a template may add around a prompt's text (role headers, default system prompt).
FRAMING_TOKENS = 1_024
#: The bound takes a prompt's bytes this many times over: a template renders some of a row's
#: structure again (tool schemas as indented JSON, or as TypeScript), which can spell it longer than
#: its JSON does. Real prompts have ~3-4 bytes per token, so the bound is loose by far; it only has
#: to be an upper bound.
BYTES_BOUND_FACTOR = 2


def tokens_bound(json_bytes: int, prompts: int = 1) -> int:
    """At most this many prompt tokens, for ``prompts`` prompts (messages and tools) of
    ``json_bytes`` UTF-8 bytes of JSON in all: a byte-level BPE token is at least one byte of the
    text it encodes, and each prompt gets its template's framing."""
    return BYTES_BOUND_FACTOR * json_bytes + prompts * FRAMING_TOKENS


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool, revision: str | None = None) -> Any:
    try:
        tokenizer = auto_tokenizer().from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                  revision=revision)
    except Exception as exc:  # hub, files or remote code: one kind of failure for the caller
        raise ConfigError(f"cannot load tokenizer {name_or_path!r}: {exc}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"tokenizer {name_or_path!r} has no chat template")
    return tokenizer


def _ids(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True), 4 a list.
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


def count_prompt_tokens(tokenizer: Any, prompts: Sequence[Prompt]) -> list[int]:
    """Prompt tokens of each prompt, in order."""
    if not prompts:
        return []
    if not getattr(tokenizer, "is_fast", False):
        return [len(_ids(tokenizer.apply_chat_template(p.messages, tools=p.tools, add_generation_prompt=True,
                                                      tokenize=True))) for p in prompts]
    # One apply_chat_template call per run of prompts with the same tools: a call's own set-up
    # (template kwargs, special tokens) cost a fifth of rendering when paid for every prompt.
    texts: list[str] = []
    for tools, run in itertools.groupby(prompts, key=lambda p: p.tools):
        texts += tokenizer.apply_chat_template([p.messages for p in run], tools=tools, add_generation_prompt=True,
                                               tokenize=False)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
