"""The target model's tokenizer: loading, the turn format read off its own chat template, and the
start-up check that every special token the rows rely on survives a round trip as one id.

Nothing here knows a model by name. ``TurnFormat`` is derived by rendering probe conversations
through the tokenizer's chat template and reading where the probe texts land, so the K2.5 form
(generation prompt ends with ``<think>``) and the K2-Thinking form (the model emits ``<think>``)
come out of the template, as do ChatML templates with ``<tool_call>`` JSON.

Everything here is synchronous CPU work on plain data: the worker runs ``rebuild`` (which calls
these methods) in ``gevent.get_hub().threadpool``, so a long answer never stalls the hub.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from common.errors import TokenizerError
from common.hf import auto_tokenizer

log = logging.getLogger(__name__)

# Probe texts: plain ASCII letters survive any template filter (strip, escape) and never meet a
# special token or each other inside a byte-level merge.
_PROBE_USER = "zqxUSERqxz"
_PROBE_REASONING = "zqxREASONINGqxz"
_PROBE_CONTENT = "zqxCONTENTqxz"
_PROBE_TOOL_NAME = "zqxTOOLqxz"
_PROBE_TOOL_ID = "zqxCALLIDqxz"
_PROBE_TOOL_ARGS = '{"zqxARGqxz": 1}'

# Keys templates read an assistant turn's reasoning from, most common first (Kimi, Qwen, DeepSeek
# read ``reasoning_content``; some newer templates read ``reasoning`` or ``thinking``).
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")

ToolCallStyle = Literal["kimi", "hermes", "none"]

# Whitespace a template may strip from the edges of reasoning or content before writing its own
# glue (Qwen3: ``reasoning_content.strip('\n')``, ``content.lstrip('\n')``); probed one at a time,
# since ``strip('\n')`` stops at a space and ``trim`` does not.
_EDGE_PROBE_CHARS = ("\n", " ", "\t")


@dataclass(frozen=True)
class StrippedEdges:
    """Characters the template strips from the start (``lead``) and end (``trail``) of a text."""

    lead: str = ""
    trail: str = ""

    def apply(self, text: str, *, lead: bool = True, trail: bool = True) -> str:
        if lead and self.lead:
            text = text.lstrip(self.lead)
        if trail and self.trail:
            text = text.rstrip(self.trail)
        return text


@dataclass(frozen=True)
class TurnFormat:
    """How the template lays out one assistant turn, as seen right after the generation prompt.

    ``reasoning_prefix + reasoning + reasoning_suffix + content + tool text + end_of_turn`` is the
    text the model generates. ``end_of_turn_tail`` is what the template writes after the
    end-of-turn token (ChatML's "\\n"): the model stops at the end token and never generates it.

    ``reasoning_edges`` / ``content_edges`` (after a reasoning block) / ``plain_content_edges`` (no
    reasoning) are what the template strips from those texts before writing its own glue: the model
    emitted the glue once, so whatever a provider kept of it must not be written twice.
    """

    generation_prompt: str
    reasoning_key: str | None
    think_open: str | None
    think_close: str | None
    prompt_opens_think: bool
    reasoning_prefix: str
    reasoning_suffix: str
    no_reasoning_prefix: str
    end_of_turn: str
    end_of_turn_tail: str
    tool_call_style: ToolCallStyle
    tool_call_open: str | None
    tool_call_ids_rendered: bool
    keeps_final_reasoning: bool
    keeps_final_reasoning_with_tool_calls: bool
    reasoning_edges: StrippedEdges = StrippedEdges()
    content_edges: StrippedEdges = StrippedEdges()
    plain_content_edges: StrippedEdges = StrippedEdges()


class _DropEncodeChatter(logging.Filter):
    """Kimi's remote tokenizer logs ``Calling super().encode with {...}`` on every kwargs call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Calling super().encode")


class _QuietStdout:
    """``sys.stdout`` stand-in that drops what a thread prints while it is inside a chatty encode.

    A plain ``redirect_stdout`` would swap the stream for every thread at once and swallow the
    output of other requests; this drops only the calling thread's writes.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.state = threading.local()

    def write(self, text: str) -> int:
        if getattr(self.state, "quiet", False):
            return len(text)
        return int(self._inner.write(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    stream = sys.stdout
    if not isinstance(stream, _QuietStdout):
        stream = sys.stdout = _QuietStdout(stream)
    stream.state.quiet = True
    try:
        yield
    finally:
        stream.state.quiet = False


class TargetTokenizer:
    """The target model's tokenizer plus the facts a rebuild needs; immutable after ``load``."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self._tok = tokenizer
        self._backend = _plain_backend(tokenizer)
        self._generated_backend = _without_normalizer(self._backend)
        self._encode_kwargs: dict[str, Any] = {}
        #: Whether ``decode`` may call the tokenizer without keyword arguments (see _choose_decode_path).
        self._plain_decode = False
        self.special_ids_by_string: dict[str, int] = {
            str(added.content): int(token_id) for token_id, added in tokenizer.added_tokens_decoder.items()
        }
        self.special_ids: frozenset[int] = frozenset(self.special_ids_by_string.values())
        # Longest first, so a special token that is a prefix of another never wins (the tokenizers
        # library matches added tokens leftmost-longest).
        ordered = sorted(self.special_ids_by_string, key=len, reverse=True)
        self.special_pattern: re.Pattern[str] | None = (
            re.compile("|".join(map(re.escape, ordered))) if ordered else None
        )
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_token: str | None = eos if isinstance(eos, str) and eos else None
        self.turn_format: TurnFormat

    # --- loading ------------------------------------------------------------------------------

    @classmethod
    def load(
        cls, name_or_path: str, *, trust_remote_code: bool, revision: str | None = None
    ) -> TargetTokenizer:
        """Load a HF tokenizer (hub id or local dir), derive its turn format, run the start-up check."""
        try:
            tokenizer = auto_tokenizer().from_pretrained(
                name_or_path, trust_remote_code=trust_remote_code, revision=revision
            )
        except Exception as exc:  # any loader failure (hub, files, remote code) is one kind for us
            raise TokenizerError(f"cannot load tokenizer {name_or_path!r}: {exc}") from exc
        if not getattr(tokenizer, "chat_template", None):
            raise TokenizerError(f"tokenizer {name_or_path!r} has no chat template")
        target = cls(name_or_path, tokenizer)
        target._choose_encode_path()
        target._choose_decode_path()
        target.turn_format = target._derive_turn_format()
        target._startup_check()
        log.info(
            "tokenizer %s ready: think %s…%s in prompt=%s, end %r, tool calls %s",
            name_or_path,
            target.turn_format.think_open,
            target.turn_format.think_close,
            target.turn_format.prompt_opens_think,
            target.turn_format.end_of_turn,
            target.turn_format.tool_call_style,
        )
        return target

    def _choose_encode_path(self) -> None:
        if self._backend is not None:
            return
        # Remote-code tokenizers (Kimi's tiktoken one) own their encode. Prefer the plain call: on
        # Kimi it is the fast path that already maps special-token text to ids, while any kwarg
        # sends it through ``super().encode``, which is slower and logs on every call.
        logging.getLogger(type(self._tok).__module__).addFilter(_DropEncodeChatter())
        probe = f"{_PROBE_USER} {_PROBE_CONTENT}"
        plain = list(self._tok.encode(probe))
        with _quiet_stdout():
            without_specials = list(self._tok.encode(probe, add_special_tokens=False))
        if plain != without_specials:
            self._encode_kwargs = {"add_special_tokens": False}

    def _choose_decode_path(self) -> None:
        if self._backend is not None:
            return
        # Kimi's tiktoken tokenizer decodes a plain ``decode(ids)`` in tiktoken (1 ms for 30k ids);
        # any keyword argument sends it through transformers' generic path (31 ms). Use the plain
        # call when it gives the same text as the explicit one on a probe holding every special
        # token and the spacing a clean-up would touch.
        specials = "".join(sorted(self.special_ids_by_string))
        probe = f"{_PROBE_USER} . , ! ? 's n't 'm 're {specials} {_PROBE_CONTENT}\n  x ,y"
        ids = self.encode(probe)
        with _quiet_stdout():
            plain = self._tok.decode(list(ids))
            explicit = self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        self._plain_decode = plain == explicit

    # --- the heavy calls (plain data in, plain data out) --------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a special-token string becomes its single id, no BOS/EOS added."""
        if not text:
            return []
        if self._backend is not None:
            # The batch call releases the GIL while Rust works, so other threads keep running.
            return list(self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        if not self._encode_kwargs:
            return list(self._tok.encode(text))
        with _quiet_stdout():
            return list(self._tok.encode(text, **self._encode_kwargs))

    def encode_generated(self, text: str) -> list[int]:
        """Token ids of text the model generated. Like ``encode`` but without the tokenizer's
        normalizer (Qwen's NFC): the server normalizes the prompt it encodes, never the tokens the
        model samples, so generated "e\u0301" is the ids of those two characters, which decode back
        to them, not the ids of "é"."""
        if self._generated_backend is None or self._generated_backend is self._backend:
            return self.encode(text)
        if not text:
            return []
        return list(self._generated_backend.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept and no clean-up of spaces."""
        if not ids:
            return ""
        if self._backend is not None:
            return str(self._backend.decode_batch([list(ids)], skip_special_tokens=False)[0])
        if self._plain_decode:
            return str(self._tok.decode(list(ids)))
        return str(
            self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, add_generation_prompt: bool
    ) -> str:
        """The chat template's text for ``messages`` (through the tokenizer's own method, which some
        remote tokenizers override, e.g. K2.5 turns ``tools`` into TypeScript declarations)."""
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        text = self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return str(text)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Ids of the prompt exactly as the model saw it: the template with the generation prompt."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def render_tool_calls(self, content: str, tool_calls: list[dict[str, Any]]) -> str:
        """The text the template puts between an assistant turn's content and its end-of-turn token
        for ``tool_calls`` (glue included: Qwen-style templates add "\\n" only after content)."""
        fmt = self.turn_format
        user = [{"role": "user", "content": _PROBE_USER}]
        with_calls = self.render(
            [*user, {"role": "assistant", "content": content, "tool_calls": tool_calls}],
            None,
            add_generation_prompt=False,
        )
        without = self.render([*user, {"role": "assistant", "content": content}], None, add_generation_prompt=False)
        ending = fmt.end_of_turn + fmt.end_of_turn_tail
        if not (with_calls.endswith(ending) and without.endswith(ending)):
            raise TokenizerError(f"tokenizer {self.name!r}: template does not end a tool-call turn with {ending!r}")
        head = without[: len(without) - len(ending)]
        if not with_calls.startswith(head):
            raise TokenizerError(f"tokenizer {self.name!r}: template renders content differently with tool calls")
        return with_calls[len(head) : len(with_calls) - len(ending)]

    def specials_in(self, text: str) -> Iterable[re.Match[str]]:
        """Every special-token string in ``text``, leftmost-longest as the tokenizer matches them."""
        return self.special_pattern.finditer(text) if self.special_pattern is not None else ()

    # --- deriving the turn format -------------------------------------------------------------

    def _render_probe(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        try:
            return self.render(messages, None, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template that cannot render a plain chat is unusable
            raise TokenizerError(f"tokenizer {self.name!r}: chat template failed on a probe chat: {exc}") from exc

    def _turn_after_prompt(self, prompt: str, assistant: dict[str, Any]) -> str:
        full = self._render_probe([{"role": "user", "content": _PROBE_USER}, assistant], add_generation_prompt=False)
        if not full.startswith(prompt):
            raise TokenizerError(
                f"tokenizer {self.name!r}: the template's generation prompt is not a prefix of the rendered "
                "assistant turn, so a completion cannot be appended to it"
            )
        return full[len(prompt) :]

    def _derive_turn_format(self) -> TurnFormat:
        user = [{"role": "user", "content": _PROBE_USER}]
        without_prompt = self._render_probe(user, add_generation_prompt=False)
        prompt = self._render_probe(user, add_generation_prompt=True)
        if not prompt.startswith(without_prompt) or prompt == without_prompt:
            raise TokenizerError(f"tokenizer {self.name!r}: template adds no generation prompt")
        generation_prompt = prompt[len(without_prompt) :]

        probe_call = {
            "id": _PROBE_TOOL_ID,
            "type": "function",
            "function": {"name": _PROBE_TOOL_NAME, "arguments": _PROBE_TOOL_ARGS},
        }
        plain_turn = self._turn_after_prompt(prompt, {"role": "assistant", "content": _PROBE_CONTENT})
        at_content = plain_turn.index(_PROBE_CONTENT)
        end_of_turn, end_of_turn_tail = self._split_end(plain_turn[at_content + len(_PROBE_CONTENT) :])
        no_reasoning_prefix = plain_turn[:at_content]

        # Which key carries reasoning, and whether the final turn keeps it (Kimi's templates drop
        # it from a final turn without tool calls: that turn is rendered as history).
        reasoning_key: str | None = None
        plain_r = tools_r = ""
        for key in _REASONING_KEYS:
            plain_r = self._turn_after_prompt(
                prompt, {"role": "assistant", key: _PROBE_REASONING, "content": _PROBE_CONTENT}
            )
            tools_r = self._turn_after_prompt(
                prompt,
                {"role": "assistant", key: _PROBE_REASONING, "content": _PROBE_CONTENT, "tool_calls": [probe_call]},
            )
            if _PROBE_REASONING in plain_r or _PROBE_REASONING in tools_r:
                reasoning_key = key
                break
        keeps_plain = reasoning_key is not None and _PROBE_REASONING in plain_r
        keeps_tools = reasoning_key is not None and _PROBE_REASONING in tools_r

        think_open = think_close = None
        reasoning_prefix = reasoning_suffix = ""
        prompt_opens_think = False
        if reasoning_key is not None:
            turn = plain_r if keeps_plain else tools_r
            at_r = turn.index(_PROBE_REASONING)
            at_c = turn.index(_PROBE_CONTENT)
            reasoning_prefix = turn[:at_r]
            reasoning_suffix = turn[at_r + len(_PROBE_REASONING) : at_c]
            # The delimiters are the special tokens right next to the reasoning (whitespace apart):
            # a special token further out (Kimi's <|im_middle|>) is not what opens it.
            open_text = prompt + reasoning_prefix
            before = list(self.specials_in(open_text))
            after = list(self.specials_in(reasoning_suffix))
            opener = before[-1] if before and not open_text[before[-1].end() :].strip() else None
            closer = after[0] if after and not reasoning_suffix[: after[0].start()].strip() else None
            if opener is None or closer is None:
                raise self._refuse_unmarked(
                    "the template's reasoning block is not delimited by special tokens",
                    ([] if opener else open_text[before[-1].end() if before else 0 :].split()[-1:])
                    + ([] if closer else reasoning_suffix[: after[0].start() if after else None].split()[:1]),
                )
            think_open, think_close = opener.group(), closer.group()
            prompt_opens_think = think_open not in reasoning_prefix

        reasoning_edges = content_edges = StrippedEdges()
        if reasoning_key is not None:
            key = reasoning_key
            extra: dict[str, Any] = {} if keeps_plain else {"tool_calls": [probe_call]}
            reasoning_edges, content_edges = self._probe_edges(
                prompt, lambda r, c: {"role": "assistant", key: r, "content": c, **extra}, with_reasoning=True
            )
        _, plain_content_edges = self._probe_edges(
            prompt, lambda r, c: {"role": "assistant", "content": c}, with_reasoning=False
        )

        # Tool calls: which special token opens them, whether the call id is part of the text.
        tools_turn = self._turn_after_prompt(
            prompt, {"role": "assistant", "content": _PROBE_CONTENT, "tool_calls": [probe_call]}
        )
        tool_text = tools_turn[tools_turn.index(_PROBE_CONTENT) + len(_PROBE_CONTENT) :]
        style: ToolCallStyle = "none"
        tool_call_open = None
        ids_rendered = _PROBE_TOOL_ID in tool_text
        if _PROBE_TOOL_NAME in tool_text or ids_rendered:
            # Kimi writes the call id (``functions.name:idx``) and no name; Hermes JSON the reverse.
            style = "kimi" if ids_rendered else "hermes"
            tool_call_open = next((m.group() for m in self.specials_in(tool_text)), None)

        return TurnFormat(
            generation_prompt=generation_prompt,
            reasoning_key=reasoning_key,
            think_open=think_open,
            think_close=think_close,
            prompt_opens_think=prompt_opens_think,
            reasoning_prefix=reasoning_prefix,
            reasoning_suffix=reasoning_suffix,
            no_reasoning_prefix=no_reasoning_prefix,
            end_of_turn=end_of_turn,
            end_of_turn_tail=end_of_turn_tail,
            tool_call_style=style,
            tool_call_open=tool_call_open,
            tool_call_ids_rendered=ids_rendered,
            keeps_final_reasoning=keeps_plain,
            keeps_final_reasoning_with_tool_calls=keeps_tools,
            reasoning_edges=reasoning_edges,
            content_edges=content_edges,
            plain_content_edges=plain_content_edges,
        )

    def _probe_edges(
        self, prompt: str, message: Callable[[str, str], dict[str, Any]], *, with_reasoning: bool
    ) -> tuple[StrippedEdges, StrippedEdges]:
        """(reasoning, content) edges the template strips, read off the probe turn rendered again
        with each whitespace character doubled around the probe texts: a copy that is gone was
        stripped. Anything else the template does with them counts as kept (the template check
        has the last word on every row anyway)."""
        base = _gaps(self._turn_after_prompt(prompt, message(_PROBE_REASONING, _PROBE_CONTENT)), with_reasoning)
        r_lead = r_trail = c_lead = c_trail = ""
        for ch in _EDGE_PROBE_CHARS:
            pad = ch * 2
            turn = self._turn_after_prompt(prompt, message(pad + _PROBE_REASONING + pad, pad + _PROBE_CONTENT + pad))
            gaps = _gaps(turn, with_reasoning)
            if base is None or gaps is None:
                continue
            if gaps[0] == base[0]:
                if with_reasoning:
                    r_lead += ch
                else:
                    c_lead += ch
            if gaps[-1] == base[-1]:
                c_trail += ch
            if with_reasoning:
                # Reasoning's end and content's start meet in one gap: which copies are left?
                for kept_r, kept_c in ((False, False), (True, False), (False, True), (True, True)):
                    if (pad if kept_r else "") + base[1] + (pad if kept_c else "") == gaps[1]:
                        r_trail += "" if kept_r else ch
                        c_lead += "" if kept_c else ch
                        break
        return StrippedEdges(r_lead, r_trail), StrippedEdges(c_lead, c_trail)

    def _split_end(self, after_content: str) -> tuple[str, str]:
        """Split what follows a turn's content into the end-of-turn text the model generates (up to
        and including the first special token) and the template's tail after it."""
        first = next(iter(self.specials_in(after_content)), None)
        if first is None:
            raise self._refuse_unmarked(
                f"the template ends an assistant turn with {after_content!r}, which holds no special token "
                "the model could stop on",
                after_content.split()[:1],
            )
        return after_content[: first.end()], after_content[first.end() :]

    def _refuse_unmarked(self, problem: str, words: Sequence[str]) -> TokenizerError:
        """The refusal for a template whose structure should be marked by special tokens and is not,
        naming why: usually the tokenizer encodes the special-token text the template writes as
        ordinary tokens (remote code that does not map it to its id, a vocabulary without it)."""
        causes, plain = [], False
        for word in words:
            ids = self.encode(word)
            if len(ids) > 1:
                plain = True
                causes.append(f"{word!r} encodes as {len(ids)} ordinary tokens {[self.decode([i]) for i in ids]}")
            elif ids:
                causes.append(f"{word!r} encodes to id {ids[0]}, which the tokenizer does not list as an added token")
        message = f"tokenizer {self.name!r}: {problem}, refusing to start"
        if causes:
            message += ": " + "; ".join(causes)
        if plain:
            message += (
                " (this tokenizer encodes special-token text as plain text, so rows would train on its "
                "characters instead of the token the model emits)"
            )
        spelled = [
            f"{token!r} encodes to {ids}, not [{token_id}]"
            for token, token_id in self.special_ids_by_string.items()
            if (ids := self.encode(token)) != [token_id]
        ]
        if spelled:
            message += f"; the special tokens it does list are spelled out too: {'; '.join(spelled[:4])}"
            message += f" (and {len(spelled) - 4} more)" if len(spelled) > 4 else ""
        return TokenizerError(message)

    # --- start-up check -----------------------------------------------------------------------

    def relied_on_specials(self) -> list[str]:
        """Special tokens that appear in the rendered probe turns, plus EOS: the ones rows carry."""
        fmt = self.turn_format
        texts = [
            fmt.generation_prompt,
            fmt.reasoning_prefix,
            fmt.reasoning_suffix,
            fmt.no_reasoning_prefix,
            fmt.end_of_turn,
            self._render_probe([{"role": "user", "content": _PROBE_USER}], add_generation_prompt=True),
        ]
        if fmt.tool_call_style != "none":
            texts.append(
                self.render_tool_calls(
                    _PROBE_CONTENT,
                    [{"id": _PROBE_TOOL_ID, "type": "function",
                      "function": {"name": _PROBE_TOOL_NAME, "arguments": _PROBE_TOOL_ARGS}}],
                )
            )
        found = {m.group() for text in texts for m in self.specials_in(text)}
        for token in (fmt.think_open, fmt.think_close, fmt.tool_call_open, self.eos_token):
            if token:
                found.add(token)
        return sorted(found)

    def _startup_check(self) -> None:
        """Refuse a tokenizer on which a relied-on special token is not one id both ways.

        This is what catches transformers' K2.5 decode bug (ids above 163588 decoded wrongly): the
        rows would be silently wrong, so the worker must not start.
        """
        problems = []
        for token in self.relied_on_specials():
            expected = self.special_ids_by_string.get(token)
            ids = self.encode(token)
            inside = self.encode(f"{_PROBE_USER}{token}{_PROBE_CONTENT}")
            back = self.decode(ids)
            if expected is None:
                problems.append(f"{token!r} is not an added token")
            elif ids != [expected]:
                problems.append(f"{token!r} encodes to {ids}, expected [{expected}]")
            elif expected not in inside:
                problems.append(f"{token!r} is not matched inside text ({inside})")
            elif back != token:
                problems.append(f"{token!r} (id {expected}) decodes to {back!r}")
        if problems:
            raise TokenizerError(
                f"tokenizer {self.name!r} fails the special-token round trip, refusing to start: "
                + "; ".join(problems)
            )


def _gaps(turn: str, with_reasoning: bool) -> list[str] | None:
    """The template's text before, between and after the probe texts of a rendered turn (None if
    a probe is missing or repeated, so the positions are not clear)."""
    probes = [_PROBE_REASONING, _PROBE_CONTENT] if with_reasoning else [_PROBE_CONTENT]
    gaps, rest = [], turn
    for probe in probes:
        if rest.count(probe) != 1:
            return None
        before, rest = rest.split(probe)
        gaps.append(before)
    return [*gaps, rest]


def _without_normalizer(backend: Any) -> Any:
    """A copy of a Rust tokenizer without its normalizer (the same object if it has none)."""
    if backend is None or backend.normalizer is None:
        return backend
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.normalizer = None
    return copy


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer behind a stock transformers fast tokenizer, or None.

    Remote-code tokenizers keep their own encode/decode (they may override them on purpose); only
    transformers' own classes are bypassed, to skip Python-side overhead on 32k-token answers.
    """
    if not type(tokenizer).__module__.startswith("transformers."):
        return None
    return getattr(tokenizer, "_tokenizer", None)
