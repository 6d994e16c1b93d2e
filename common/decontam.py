"""Eval sets kept out: a prompt sharing an n-gram run with an evaluation prompt is never asked.

``[run] exclude`` names evaluation prompt sets (paths or globs, each read by ``read_prompts`` like a
dataset: JSONL, compressed JSONL, Parquet, a saved folder); ``[run] exclude_ngram`` (13) is the run
length in words, as published decontamination counts (GPT-3's, Llama's: 13 whitespace-split,
lowercased words). Every n-gram of every eval prompt's text (its messages' contents joined by a
space) is kept as a 64-bit hash naming the eval item (``file:line`` and id); a dataset prompt that
has one of them is skipped before paying and written to ``excluded.jsonl``. An eval prompt shorter
than n words matches only a prompt of the same words (a run of 3 common words is no leak).

Eval sets are small (thousands of prompts): the hashes live in a dict, ~100 bytes an n-gram.
Python's string hash is salted per process, so an index is used in the process that built it (or a
fork of it), never stored.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.datasets import DEFAULT_MAX_LINE_BYTES, ReadStats, read_prompts
from common.errors import ConfigError, DatasetRowError

DEFAULT_NGRAM = 13


def prompt_words(messages: list[dict[str, Any]]) -> list[str]:
    """The prompt's text as lowercased whitespace-split words, every message's content in order."""
    return " ".join(str(m.get("content") or "") for m in messages).lower().split()


@dataclass(frozen=True)
class EvalItem:
    where: str
    id: str

    def to_json(self) -> dict[str, str]:
        return {"where": self.where, "id": self.id}


class EvalIndex:
    """The n-grams of the excluded eval sets, each naming the first eval item that has it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.items: list[EvalItem] = []
        self._grams: dict[int, int] = {}
        #: Eval prompts shorter than a run, whole.
        self._whole: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._grams) + len(self._whole)

    def add(self, item: EvalItem, words: list[str]) -> None:
        index = len(self.items)
        self.items.append(item)
        if not words:
            return
        if len(words) < self.n:
            self._whole.setdefault(hash(tuple(words)), index)
            return
        for i in range(len(words) - self.n + 1):
            self._grams.setdefault(hash(tuple(words[i:i + self.n])), index)

    def match(self, words: list[str]) -> tuple[EvalItem, str] | None:
        """The eval item the words share a run with and the run itself, or None."""
        if self._whole and len(words) < self.n and (index := self._whole.get(hash(tuple(words)))) is not None:
            return self.items[index], " ".join(words)
        grams, n = self._grams, self.n
        for i in range(len(words) - n + 1):
            gram = tuple(words[i:i + n])
            index = grams.get(hash(gram))
            if index is not None:
                return self.items[index], " ".join(gram)
        return None


def exclude_files(patterns: list[str], base: Path | None = None) -> list[Path]:
    """The paths ``[run] exclude`` names (globs expanded; a pattern that names nothing is an error)."""
    out: list[Path] = []
    for i, pattern in enumerate(patterns):
        path = Path(pattern) if base is None or Path(pattern).is_absolute() else base / pattern
        if set("*?[") & set(str(path)):
            found = sorted(Path(p) for p in glob.glob(str(path)))
            if not found:
                raise ConfigError(f"[run] exclude[{i}]: {pattern}: no file matches")
            out += found
        elif path.exists():
            out.append(path)
        else:
            raise ConfigError(f"[run] exclude[{i}]: {pattern}: no such file or folder")
    return out


def build_eval_index(paths: list[Path], n: int = DEFAULT_NGRAM) -> EvalIndex:
    """Every eval prompt of ``paths`` read as a dataset's prompts are (bad rows are left out)."""
    index = EvalIndex(n)
    for path in paths:
        errors: list[DatasetRowError] = []
        for prompt in read_prompts(path, errors, ReadStats(), max_line_bytes=DEFAULT_MAX_LINE_BYTES):
            index.add(EvalItem(prompt.where, prompt.id), prompt_words(prompt.messages))
    return index
