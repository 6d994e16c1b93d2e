"""What a run leaves out before paying, decided at the reader: duplicates and eval leaks.

One ``RunFilter`` per run (the plan has its own): every read of dataset k (the plan's count, the
run's first read, a sweep, a top-up round) goes through a ``DatasetScreen`` of it, so the plan and
the run leave out the same prompts, and every read of the same dataset the same ones.

- **Eval leaks** (``[run] exclude``, common/decontam.py): checked first, so a leaked prompt is
  neither asked nor shared.
- **Duplicates** (``[run] duplicates`` not ``ask``, common/dedup.py): a prompt is a duplicate when
  an earlier dataset of the run (config order) asks the same normalised prompt, or an earlier row
  of its own file does. The first copy is the one asked, and its dataset's budget pays for it. The
  run-wide index holds, for each fingerprint, the first dataset that asks it; dataset k's screen
  needs datasets 0..k-1 in it, so ``prepare(k)`` reads any of them not yet indexed (the run's first
  read of a dataset indexes it when it reaches its end, as the plan's count does: a second read
  happens only when a budget stop left the first one unfinished). A read's own earlier rows are a
  second index of that read alone; at its end it becomes the dataset's entry in the run's index.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from common.config import DatasetConfig, RunConfig
from common.datasets import Prompt, ReadStats, read_prompts
from common.decontam import EvalIndex, build_eval_index, exclude_files, prompt_words
from common.dedup import MAX_DATASETS, FingerprintIndex, fingerprint
from common.errors import ConfigError, DatasetRowError

#: Called for each duplicate left out: (the prompt, its fingerprint, the index of the dataset that asks it).
OnDuplicate = Callable[[Prompt, int, int], None]


class RunFilter:
    def __init__(self, cfg: RunConfig, *, eval_index: EvalIndex | None = None) -> None:
        self.datasets = list(cfg.datasets)
        self.duplicates = cfg.run.duplicates
        if self.duplicates != "ask" and len(self.datasets) > MAX_DATASETS:
            raise ConfigError(f"[run] duplicates = {self.duplicates!r}: at most {MAX_DATASETS} datasets "
                              f"(this run has {len(self.datasets)}); set duplicates = \"ask\"")
        self._exclude = cfg.run.exclude
        self._ngram = cfg.run.exclude_ngram
        self._eval = eval_index
        self.index = FingerprintIndex()
        self._indexed: set[int] = set()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Anything to leave out: otherwise reads need no screen."""
        return self.duplicates != "ask" or bool(self._exclude)

    def eval_index(self) -> EvalIndex | None:
        if self._eval is None and self._exclude:
            self._eval = build_eval_index(exclude_files(self._exclude), self._ngram)
        return self._eval

    def position(self, ds: DatasetConfig) -> int:
        return next(i for i, d in enumerate(self.datasets) if d.name == ds.name)

    def prepare(self, k: int) -> None:
        """Datasets 0..k-1 in the run's index (each read to its end, once)."""
        if self.duplicates == "ask":
            return
        for j in range(k):
            if j not in self._indexed:
                for _ in self.read(self.datasets[j], [], ReadStats()):
                    pass

    def screen(self, ds: DatasetConfig, *, on_excluded: Callable[[dict[str, Any]], None] | None = None,
               on_duplicate: OnDuplicate | None = None) -> DatasetScreen:
        k = self.position(ds)
        self.prepare(k)
        return DatasetScreen(self, k, self.eval_index(), on_excluded, on_duplicate)

    def read(self, ds: DatasetConfig, errors: list[DatasetRowError], stats: ReadStats, *,
             on_excluded: Callable[[dict[str, Any]], None] | None = None,
             on_duplicate: OnDuplicate | None = None) -> Iterator[Prompt]:
        """``read_prompts`` of the dataset, through its screen when there is anything to leave out."""
        screen = self.screen(ds, on_excluded=on_excluded, on_duplicate=on_duplicate) if self.active else None
        return read_prompts(ds.path, errors, stats, limit=ds.max_prompts, max_line_bytes=ds.max_line_bytes,
                            screen=screen)

    def _indexed_now(self, k: int, seen: FingerprintIndex) -> None:
        with self._lock:
            if k in self._indexed:
                return
            if k < len(self.datasets) - 1:  # the last dataset's are no later one's first copies
                seen.copy_into(self.index, k)
            self._indexed.add(k)


class DatasetScreen:
    """One read of dataset ``k``: its eval leaks and duplicates, left out (``common.datasets.Screen``)."""

    def __init__(self, run: RunFilter, k: int, eval_index: EvalIndex | None,
                 on_excluded: Callable[[dict[str, Any]], None] | None, on_duplicate: OnDuplicate | None) -> None:
        self._run, self._k, self._eval = run, k, eval_index
        self._dedup = run.duplicates != "ask"
        self._on_excluded, self._on_duplicate = on_excluded, on_duplicate
        self._seen = FingerprintIndex()

    def skip(self, prompt: Prompt, stats: ReadStats) -> bool:
        if self._eval is not None and (hit := self._eval.match(prompt_words(prompt.messages))) is not None:
            stats.excluded += 1
            if self._on_excluded is not None:
                item, run = hit
                self._on_excluded({"id": prompt.id, "where": prompt.where, "matched": item.to_json(), "ngram": run})
            return True
        if not self._dedup:
            return False
        fp = fingerprint(prompt.messages, prompt.tools)
        owner = self._run.index.owner(fp)
        if owner is None or owner >= self._k:
            owner = self._seen.add(fp, self._k)
            if owner is None:
                return False
        stats.duplicate_prompts += 1
        if self._on_duplicate is not None:
            self._on_duplicate(prompt, fp, owner)
        return True

    def done(self) -> None:
        if self._dedup:
            self._run._indexed_now(self._k, self._seen)
            self._seen = FingerprintIndex()  # read to its end: a kept stream need not keep its index

