"""Engine-ids mode: answer like vLLM's OpenAI server does for ``return_token_ids: true``.

vLLM (``vllm-project/vllm:tests/entrypoints/openai/test_return_token_ids.py``) puts ``prompt_token_ids`` at the top
level of a chat completion and ``token_ids`` in each choice:

- ``prompt_token_ids``: the tokenizer's chat template rendered with the generation prompt
  (``apply_chat_template(messages, tools=…, add_generation_prompt=True, tokenize=False)``), then
  encoded without added BOS/EOS, special-token text matched as one id. The simulator does exactly
  that with the tokenizer it was started with (``--tokenizer``: its ``tokenizer.json`` and the chat
  template in ``tokenizer_config.json``).
- ``token_ids``: what the model sampled, here the simulator's own rendering of the assistant turn
  (Kimi form: ``reasoning</think>content<tool section><|im_end|>``, with ``<think>`` first when the
  generation prompt does not open it and ``</think>`` first when reasoning is off but the prompt
  opened it) encoded with the same tokenizer. vLLM keeps the stop token the model sampled when it is
  an EOS/stop token id (its test: ``decode(token_ids) == content + "<|im_end|>"``), so the ids end
  with ``<|im_end|>`` when ``finish_reason`` is ``stop`` or ``tool_calls`` and do not on
  ``length``. A leaked ``<|im_end|>`` in ``content`` is the provider's, not a second sampled token.

None of this goes through ``workers/``: the ids come from the simulator's own text and tokenizer,
so the client's rebuild can be checked against them.

Non-canonical tokenizations: a model can sample ``"hel" + "lo"`` where encoding the text gives
``"hello"``. With ``noncanonical_rate`` (or a ``#sim`` ``noncanonical`` key) one token of the
completion is replaced by two vocabulary tokens whose strings join to its string, so the ids decode
to the same text but differ from the canonical encoding. Which prompts get one is seeded by
(seed, prompt), so a retry gets the same ids.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.answers import Answer
from simulator.kimi import THINK, THINK_END

MAX_SPLIT_TRIES = 64  # random positions tried before scanning the whole completion


class EngineIdsError(ValueError):
    """The simulator cannot return token ids (no tokenizer, no chat template)."""


@dataclass(frozen=True)
class Injection:
    """One token of the canonical ids replaced by two that decode to the same text."""

    position: int  # index in token_ids of the first of the two pieces
    canonical_id: int
    ids: tuple[int, int]
    canonical_token: str
    tokens: tuple[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "canonical_id": self.canonical_id,
                "ids": list(self.ids), "canonical_token": self.canonical_token,
                "tokens": list(self.tokens)}


@dataclass(frozen=True)
class EngineIds:
    prompt_ids: list[int]
    token_ids: list[int]
    reasoning_tokens: int
    injection: Injection | None
    #: Where the answer puts them (``script.ID_SHAPES``).
    shape: str = "vllm"


class EngineTokenizer:
    """The tokenizer and chat template the simulated engine serves with."""

    def __init__(self, backend: Any, path: str) -> None:
        self._tok = backend  # tokenizers.Tokenizer
        file = Path(path)
        self._dir = file if file.is_dir() else file.parent
        self._template: Any = None  # transformers tokenizer, loaded on the first use
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    def _chat(self) -> Any:
        if self._template is None:
            from transformers import AutoTokenizer  # only in this mode: a slow import

            try:
                tok = AutoTokenizer.from_pretrained(str(self._dir))
            except Exception as exc:
                raise EngineIdsError(f"tokenizer {self._dir}: cannot load: {exc}") from exc
            if not getattr(tok, "chat_template", None):
                raise EngineIdsError(f"tokenizer {self._dir}: no chat template")
            self._template = tok
        return self._template

    def render_prompt(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Any]) -> str:
        kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            text = self._chat().apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=True, **kwargs)
        except EngineIdsError:
            raise
        except Exception as exc:  # a template that rejects these messages: the request's fault
            raise EngineIdsError(f"chat template failed on these messages: {exc}") from exc
        return str(text)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False)) if ids else ""

    def token(self, token_id: int) -> str:
        return str(self._tok.id_to_token(token_id))

    def split(self, ids: list[int], rng: random.Random) -> tuple[list[int], Injection] | None:
        """``ids`` with one ordinary token replaced by two that decode to the same text, or None
        when no token of ``ids`` splits into two vocabulary tokens."""
        if not ids:
            return None
        order = [rng.randrange(len(ids)) for _ in range(MAX_SPLIT_TRIES)]
        rest = list(range(len(ids)))
        rng.shuffle(rest)
        text = None
        for pos in order + rest:
            pieces = self._pieces(ids[pos], rng)
            if pieces is None:
                continue
            new = [*ids[:pos], *pieces, *ids[pos + 1:]]
            text = text if text is not None else self.decode(ids)
            if self.decode(new) != text:  # a decoder that does not simply concatenate
                continue
            return new, Injection(pos, ids[pos], pieces, self.token(ids[pos]),
                                  (self.token(pieces[0]), self.token(pieces[1])))
        return None

    def _pieces(self, token_id: int, rng: random.Random) -> tuple[int, int] | None:
        if token_id in self._special_ids:
            return None
        s = self.token(token_id)
        cuts = list(range(1, len(s)))
        rng.shuffle(cuts)
        for cut in cuts:
            left, right = self._tok.token_to_id(s[:cut]), self._tok.token_to_id(s[cut:])
            if left is not None and right is not None \
                    and left not in self._special_ids and right not in self._special_ids:
                return int(left), int(right)
        return None


def completion_text(answer: Answer, prompt_text: str) -> str:
    """The assistant turn as the model emitted it after ``prompt_text``."""
    body = "".join(answer.completion_parts())
    opened = prompt_text.endswith(THINK)
    if answer.reasoning is None:
        # Reasoning off, but the prompt opened the block: the model closes it at once.
        return THINK_END + body if opened and body else body
    return body if opened else THINK + body


def engine_ids(tok: EngineTokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any],
               answer: Answer, *, inject: bool, rng: random.Random) -> EngineIds:
    prompt_text = tok.render_prompt(messages, tools)
    ids = tok.encode(completion_text(answer, prompt_text))
    injection = None
    if inject:
        split = tok.split(ids, rng)
        if split is not None:
            ids, injection = split
    return EngineIds(prompt_ids=tok.encode(prompt_text), token_ids=ids,
                     reasoning_tokens=_reasoning_tokens(tok, ids, answer), injection=injection)


def _reasoning_tokens(tok: EngineTokenizer, ids: list[int], answer: Answer) -> int:
    if not answer.reasoning:
        return 0
    think_end = tok.encode(THINK_END)
    if len(think_end) == 1 and think_end[0] in ids:
        start = 1 if ids and tok.encode(THINK) == ids[:1] else 0
        return ids.index(think_end[0]) - start
    return len(ids)  # cut by max_tokens inside the reasoning: every id is reasoning
