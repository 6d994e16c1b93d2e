"""Degenerate answers: marked on their row (``quality``) so a run can keep them apart.

Three kinds, each a thing reasoning models do that a drafter should not learn from as if it were
a normal turn (speculators RFC #584):

- ``repetition``: the answer loops: n-grams of ``NGRAM_WORDS`` words seen at least
  ``MIN_REPEATS`` times cover more than ``MIN_COVERED`` of its words (its content, or its reasoning);
- ``empty_content``: the turn ended after its reasoning with no content and no tool call;
- ``unclosed_reasoning``: the turn ended inside its reasoning (no think-close: the reasoning parser
  handed back content null, no tool call).

Cut answers (``finish_reason = "length"``) are the ``truncated`` policy's; a cut answer that loops is
still marked ``repetition``. Where a marked row goes is ``[request] degenerate`` (producer/rows.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from common.rebuild import ENDED_FINISH_REASONS, AnswerParts

#: Words per n-gram: long enough that ordinary prose (stock phrases, lists) rarely repeats one
#: three times, short enough that a looping sentence is several of them.
NGRAM_WORDS = 8
MIN_REPEATS = 3
#: "Most of the answer".
MIN_COVERED = 0.5
#: Shorter texts are not judged: a few words cannot loop in a way that matters.
MIN_WORDS = 40

DEGENERATE_REASONS = ("repetition", "empty_content", "unclosed_reasoning")


def repeated_share(text: str) -> float:
    """The share of the text's words inside an n-gram that occurs ``MIN_REPEATS`` times or more."""
    words = text.split()
    if len(words) < MIN_WORDS:
        return 0.0
    grams = [tuple(words[i:i + NGRAM_WORDS]) for i in range(len(words) - NGRAM_WORDS + 1)]
    counts = Counter(grams)
    covered = [False] * len(words)
    for i, gram in enumerate(grams):
        if counts[gram] >= MIN_REPEATS:
            covered[i:i + NGRAM_WORDS] = [True] * NGRAM_WORDS
    return sum(covered) / len(words)


def quality_of(answer: AnswerParts) -> dict[str, Any] | None:
    """The row's ``quality`` mark (``{"degenerate": reason, …}``), or None for an answer that is none of them."""
    ended = answer.finish_reason in ENDED_FINISH_REASONS
    reasoning = (answer.reasoning or "").strip()
    if ended and reasoning and not answer.tool_calls:
        if answer.content is None:
            return {"degenerate": "unclosed_reasoning"}
        if not answer.content.strip():
            return {"degenerate": "empty_content"}
    covered = max(repeated_share(answer.content or ""), repeated_share(reasoning))
    if covered > MIN_COVERED:
        return {"degenerate": "repetition", "covered": round(covered, 3)}
    return None


def is_degenerate(row: dict[str, Any]) -> bool:
    quality = row.get("quality")
    return isinstance(quality, dict) and quality.get("degenerate") in DEGENERATE_REASONS
