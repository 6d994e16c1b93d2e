"""Each distinct prompt asked once: prompts keyed by a normalised form, as 8-byte fingerprints.

The normalised form of a prompt is its messages and tools with every string in Unicode NFC and its
whitespace collapsed (runs of spaces, tabs and newlines as one space, none at the ends), as
canonical JSON: two rows that differ only there are one prompt. Its fingerprint is 64 bits of
blake2b.

``FingerprintIndex`` keeps, for every fingerprint, the first dataset of the run that asks it, in one
open-addressed ``array('Q')``: the top 56 bits of the fingerprint and the dataset's index + 1 in
the low 8 (0 is an empty slot). 8 bytes a slot, at a load of 0.35-0.7: 11-23 bytes a prompt, 128
MiB for 10M prompts (``bench/dedup_run.py`` measures it), against ~100 bytes a prompt for a Python
set of ints. Two different prompts share 56 bits with odds ~n²/2⁵⁷ (7e-4 at 10M): the second would
be taken for a duplicate of the first.
"""

from __future__ import annotations

import hashlib
import threading
import unicodedata
from array import array
from typing import Any

import orjson

#: Datasets an index tells apart (the low 8 bits of a slot, 0 meaning empty).
MAX_DATASETS = 255
_OWNER_BITS = 8
_OWNER_MASK = (1 << _OWNER_BITS) - 1


def _normal(value: Any) -> Any:
    if isinstance(value, str):
        return " ".join(unicodedata.normalize("NFC", value).split())
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normal(v) for v in value]
    return value


def fingerprint(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """The prompt's normalised form as 64 bits (never 0)."""
    canonical = orjson.dumps([_normal(messages), _normal(tools)], option=orjson.OPT_SORT_KEYS)
    return int.from_bytes(hashlib.blake2b(canonical, digest_size=8).digest(), "little") or 1


class FingerprintIndex:
    """Fingerprint -> the first owner (an int 0..254) that added it; thread-safe."""

    _MAX_LOAD = 0.7

    def __init__(self, slots: int = 1024) -> None:
        self._slots = array("Q", bytes(8 * max(1024, 1 << (slots - 1).bit_length())))
        self._used = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._used

    @property
    def bytes(self) -> int:
        return self._slots.itemsize * len(self._slots)

    def _probe(self, key: int) -> tuple[int, int | None]:
        """Linear probing for ``key``: its slot's index and owner, or the empty slot it would take and None."""
        slots = self._slots
        mask = len(slots) - 1
        i = key & mask
        while held := slots[i]:
            if held >> _OWNER_BITS == key:
                return i, (held & _OWNER_MASK) - 1
            i = (i + 1) & mask
        return i, None

    def owner(self, fp: int) -> int | None:
        """Who added ``fp`` first, or None."""
        return self._probe(fp >> _OWNER_BITS)[1]

    def add(self, fp: int, owner: int) -> int | None:
        """Record ``fp`` for ``owner``; the earlier owner when it was already there (kept), else None."""
        if not 0 <= owner < MAX_DATASETS:
            raise ValueError(f"owner {owner} is not in 0..{MAX_DATASETS - 1}")
        key = fp >> _OWNER_BITS
        with self._lock:
            i, first = self._probe(key)
            if first is not None:
                return first
            self._slots[i] = (key << _OWNER_BITS) | (owner + 1)
            self._used += 1
            if self._used > self._MAX_LOAD * len(self._slots):
                self._grow()
        return None

    def copy_into(self, other: FingerprintIndex, owner: int) -> None:
        """Every fingerprint of this index added to ``other`` for ``owner`` (first owners kept)."""
        for held in self._slots:
            if held:
                other.add(held, owner)

    def _grow(self) -> None:
        old = self._slots
        slots = array("Q", bytes(16 * len(old)))
        mask = len(slots) - 1
        for held in old:
            if held:
                i = (held >> _OWNER_BITS) & mask
                while slots[i]:
                    i = (i + 1) & mask
                slots[i] = held
        self._slots = slots  # one assignment: a reader without the lock sees the old array or the new one
