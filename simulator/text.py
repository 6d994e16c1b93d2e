"""Deterministic filler text: words, sentences and JSON values drawn from a seeded RNG.

``generate_text(rng, n)`` holds exactly ``n`` tokens under the simple counting rule
(``tokens.SimpleCounter``): every word is one ``\\w+`` run, every punctuation mark and emoji one
character. Non-ASCII words and single-code-point emoji appear now and then, so a client's
byte/char/token handling meets them without asking.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

_ASCII_TEXT = (
    "the a of to and in that is for it as with on be by this are or from at an we can which "
    "model token answer question value result step first next then check case data request "
    "function number string list order time count budget prompt reason think consider maybe "
    "should would could because therefore however also simple example input output error "
    "retry batch queue worker cache limit rate price cost total small large fast slow good "
    "better best clear exact same different other each every some many few more less most "
    "test write read parse build run start stop keep drop send return call compute sort merge "
    "split join find match map filter reduce sum mean median range index key field record row "
    "file path line word text byte char unicode space note look see know need want use try "
    "user system assistant tool city weather Paris Tokyo Berlin Lima Oslo 42 7 2024 100 3"
)
_ASCII_WORDS = tuple(_ASCII_TEXT.split())

# Each is one \w+ run (no apostrophes, hyphens or combining marks), so it counts as one token.
_NON_ASCII_TEXT = (
    "café naïve über Straße façade jalapeño résumé smörgåsbord crème Zürich São Kraków piñata "
    "ñandú 日本語 数据 東京 данные привет λόγος αλφα שלום مرحبا 한국어 Ελλάδα"
)
_NON_ASCII_WORDS = tuple(_NON_ASCII_TEXT.split())

# Single code points with default emoji presentation: one token each, no joiners or selectors.
_EMOJI = ("🙂", "🚀", "✨", "🔥", "📦", "🎉", "🤖", "✅")

EMOJI_RATE = 0.05  # per sentence
COMMA_RATE = 0.4  # per sentence
PARAGRAPH_RATE = 0.15  # per sentence end

# ASCII words repeated so that about 5% of words are non-ASCII with one unweighted choice.
_POOL = _ASCII_WORDS * 3 + _NON_ASCII_WORDS
_MAX_SENTENCE_TOKENS = 18 + 3  # words, a comma, an emoji, the period
_CORPUS_SIZE = 4096
_CORPUS_SEED = 0x5EED  # fixed: the corpus is part of the answer format, the same everywhere


def phrase(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choices(_POOL, k=n_words))


def sentence(rng: random.Random, left: int | None = None) -> tuple[str, int]:
    """One sentence and its token count; with ``left``, exactly that many tokens (no period if
    only one is left), else 6..18 words."""
    n_words = 6 + int(rng.random() * 13)  # randint costs 3x more per call
    comma = rng.random() < COMMA_RATE
    emoji = rng.random() < EMOJI_RATE
    period = True
    if left is not None:
        emoji = False
        comma = comma and left >= 5
        period = left >= 2
        n_words = left - comma - period
    words = rng.choices(_POOL, k=n_words)
    words[0] = words[0][:1].upper() + words[0][1:]
    if comma:
        words[1 + int(rng.random() * (n_words - 2))] += ","  # not first, not last
    text = " ".join(words)
    if emoji:
        text += " " + rng.choice(_EMOJI)
    return text + ("." if period else ""), n_words + comma + emoji + period


# Whole answers are strung from this fixed corpus, two RNG draws a sentence instead of a dozen:
# the server makes well over a thousand answers a second on one core.
_corpus_rng = random.Random(_CORPUS_SEED)
_CORPUS: tuple[tuple[str, int], ...] = tuple(sentence(_corpus_rng) for _ in range(_CORPUS_SIZE))


def sample_text() -> str:
    """A stretch of the corpus, to calibrate another tokenizer against the simple rule."""
    return " ".join(text for text, _ in _CORPUS[:400])


def generate_text(rng: random.Random, n_tokens: int) -> str:
    """Sentences of exactly ``n_tokens`` simple-rule tokens, ending with a period when n >= 2."""
    out: list[str] = []
    left = n_tokens
    while left > 0:
        if out:
            out.append("\n\n" if rng.random() < PARAGRAPH_RATE else " ")
        if left > _MAX_SENTENCE_TOKENS:
            text, n = _CORPUS[int(rng.random() * _CORPUS_SIZE)]
        else:
            text, n = sentence(rng, left)
        out.append(text)
        left -= n
    return "".join(out)


def schema_value(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A plausible value for a JSON schema (enough of it for tool-call arguments)."""
    if not isinstance(schema, Mapping):
        return phrase(rng, rng.randint(1, 3))
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return schema_value(rng.choice(options), rng, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None and "properties" in schema:
        kind = "object"
    if kind == "object":
        props = schema.get("properties")
        if depth >= 4 or not isinstance(props, Mapping):
            return {}
        required = set(schema.get("required") or ())
        return {
            name: schema_value(sub, rng, depth + 1)
            for name, sub in props.items()
            if name in required or rng.random() < 0.5
        }
    if kind == "array":
        if depth >= 4:
            return []
        n = max(int(schema.get("minItems", 1)), rng.randint(1, 3))
        return [schema_value(schema.get("items"), rng, depth + 1) for _ in range(n)]
    if kind == "integer":
        lo = int(schema.get("minimum", 0))
        hi = int(schema.get("maximum", lo + 100))
        return rng.randint(lo, max(lo, hi))
    if kind == "number":
        lo_f = float(schema.get("minimum", 0.0))
        hi_f = float(schema.get("maximum", lo_f + 100.0))
        return round(rng.uniform(lo_f, max(lo_f, hi_f)), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return phrase(rng, rng.randint(1, 3))
