"""``[run] duplicates = "share"``: a duplicate's dataset gets the first copy's row, in ``shared.jsonl``.

A duplicate is never asked (``common/prompt_filter.py``): the first copy is, and its dataset's budget
pays (tokens and dollars); the duplicate's dataset is charged nothing for the row it gets. When the
duplicate's dataset has drained and every earlier dataset has ended, its file is read again for its
duplicates, the first copy's id found by reading the owning dataset again, and the first copy's
kept rows (shards, truncated.jsonl, dropped stubs: what its budget kept) copied under the
duplicate's id and ``where``, marked ``duplicate_of: {"dataset", "id"}``. A first copy with no kept
row (its dataset's budget stopped first, it failed) leaves its duplicates not kept, counted as
``shared_not_kept``: a rerun (resume) writes the file again from what is kept then.

Exactly once: ``shared.jsonl`` is written whole to a temporary file and renamed, each time, from the
shards alone: each duplicate's copy is there once, whatever crashed before. Memory: at most
``CHUNK`` duplicates are held at a time (each chunk reads the owning datasets again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import DatasetConfig
from common.datasets import Prompt, ReadStats
from common.dedup import fingerprint
from common.prompt_filter import RunFilter
from producer.rows import jsonl_line

SHARED_FILE = "shared.jsonl"
#: Duplicates held at once (~200 bytes each).
CHUNK = 100_000


@dataclass
class Shared:
    rows: int = 0
    prompts: int = 0
    not_kept: int = 0


def write_shared(folder: Path, filt: RunFilter, ds: DatasetConfig,
                 kept_rows: Callable[[str], Iterator[dict[str, Any]]], *, chunk: int = CHUNK) -> Shared:
    """``folder/shared.jsonl`` for dataset ``ds``; ``kept_rows(name)``: a dataset's kept rows."""
    result = Shared()
    tmp = folder / (SHARED_FILE + ".tmp")
    pending: dict[int, list[tuple[str, str]]] = {}
    owner_of: dict[int, int] = {}
    with tmp.open("wb") as out:
        def flush() -> None:
            for d in sorted(set(owner_of.values())):
                _copy_from(filt.datasets[d], filt, {fp for fp, o in owner_of.items() if o == d}, pending, kept_rows,
                           out, result)
            pending.clear()
            owner_of.clear()

        def on_duplicate(prompt: Prompt, fp: int, owner: int) -> None:
            pending.setdefault(fp, []).append((prompt.id, prompt.where))
            owner_of[fp] = owner
            if len(owner_of) >= chunk:
                flush()

        for _ in filt.read(ds, [], ReadStats(), on_duplicate=on_duplicate):
            pass
        flush()
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, folder / SHARED_FILE)
    return result


def _copy_from(owner: DatasetConfig, filt: RunFilter, fps: set[int], pending: dict[int, list[tuple[str, str]]],
               kept_rows: Callable[[str], Iterator[dict[str, Any]]], out: Any, result: Shared) -> None:
    first: dict[str, int] = {}  # the first copy's id -> its fingerprint
    found: set[int] = set()
    for prompt in filt.read(owner, [], ReadStats()):
        if len(found) == len(fps):
            break
        fp = fingerprint(prompt.messages, prompt.tools)
        if fp in fps and fp not in found:
            first[prompt.id] = fp
            found.add(fp)
    copied: set[int] = set()
    for row in kept_rows(owner.name):
        fp_of_row = first.get(row.get("id"))  # type: ignore[arg-type]
        if fp_of_row is None:
            continue
        copied.add(fp_of_row)
        for dup_id, where in pending[fp_of_row]:
            copy = {**row, "id": dup_id, "where": where, "duplicate_of": {"dataset": owner.name, "id": row["id"]}}
            if "key" in row:  # a regenerated turn's key is "<id>#<turn>"
                copy["key"] = dup_id + row["key"][len(row["id"]):]
            out.write(jsonl_line(copy))
            result.rows += 1
    for fp in fps:
        if fp in copied:
            result.prompts += len(pending[fp])
        else:
            result.not_kept += len(pending[fp])
