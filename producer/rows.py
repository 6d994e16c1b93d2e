"""Where kept rows go on disk: the ``RowWriter`` protocol and its JSONL-shard implementation.

The collector (``producer/collector.py``) owns the results streams; a ``RowWriter`` owns one
dataset's folder. The contract that makes "each kept row exactly once" hold across crashes:

- ``write(rows, last_id)`` makes the rows *and* the stream position ``last_id`` durable together:
  after a crash either both are on disk or neither is;
- ``recover()`` (called once, before the first write) cuts off whatever a crash left after the last
  durable position, so the collector can read the stream again from ``last_id``;
- ``iter_kept()`` yields the rows that are durable, in order (the run rebuilds Redis from them
  when Redis lost what the disk holds).

A new output format is one new class here plus one entry in ``ROW_FORMATS``.
A write the folder refuses (disk full, read-only, file size limit) raises ``OutputError``: the
collector stops, the rows stay in the Redis stream, and the next run writes them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import orjson

from common.errors import OutputError

log = logging.getLogger(__name__)

CHECKPOINT = ".checkpoint.json"


class RowWriter(Protocol):
    """One dataset's kept rows on disk, written in batches, each batch durable with its position."""

    #: Stream id of the last durable row ("0-0" before the first): the collector reads after it.
    @property
    def last_id(self) -> str: ...

    #: Rows durable on disk.
    @property
    def rows(self) -> int: ...

    def recover(self) -> None:
        """Cut off what a crash left after the last durable position."""

    def write(self, rows: Sequence[dict[str, Any]], last_id: str) -> None:
        """Make ``rows`` and the stream position ``last_id`` durable together."""

    def iter_kept(self) -> Iterator[dict[str, Any]]:
        """The durable rows, in the order they were written."""

    def files(self) -> list[str]:
        """Names of the files holding the rows (for the summary)."""


def output_error(path: Path, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {exc.strerror or exc}; rows not yet written wait in Redis: "
                       "free the output folder, then run the same command again")


def atomic_write(path: Path, text: str) -> None:
    """Write a whole small file (summary, failures) so a reader never sees half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        raise output_error(path, exc) from None


# --- JSONL shards + byte-offset checkpoint --------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    shard: int = 0
    offset: int = 0
    rows_in_shard: int = 0
    last_id: str = "0-0"
    rows: int = 0


# Characters str.splitlines() (and some JSONL readers) treat as line breaks, which JSON may carry
# raw inside strings: escaped, a row is one line for every reader. In UTF-8 these byte sequences
# can only be those characters (a lead byte never occurs inside another character). Each comes
# with its last byte: found at memchr speed, it is absent from most rows, and only then is the
# slower search for the whole sequence (as long as encoding the row) needed.
_LINE_BREAKS = ((b"\x85", b"\xc2\x85", b"\\u0085"), (b"\xa8", b"\xe2\x80\xa8", b"\\u2028"),
                (b"\xa9", b"\xe2\x80\xa9", b"\\u2029"))


def jsonl_line(row: dict[str, Any]) -> bytes:
    """One row as a line of compact UTF-8 JSON.

    orjson writes a row of thousands of token ids about ten times faster than ``json.dumps`` (which
    was the collector's largest cost). What it refuses (nesting deeper than 255) goes through
    ``json``; both write the same values.
    """
    try:
        line = orjson.dumps(row)
    except orjson.JSONEncodeError:
        line = json.dumps(row, ensure_ascii=False, separators=(",", ":")).encode()
    if not line.isascii():
        for last, raw, escaped in _LINE_BREAKS:
            if last in line:
                line = line.replace(raw, escaped)
    return line + b"\n"


def shard_path(dataset_dir: Path, shard: int) -> Path:
    return dataset_dir / f"shard-{shard:05d}.jsonl"


def _shard_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JsonlShards:
    """``shard-NNNNN.jsonl`` files of ``shard_rows`` rows each, plus ``.checkpoint.json``.

    A batch is appended to the open shard (rolling to new ones as they fill) and fsynced, then the
    checkpoint (shard, byte offset, rows in shard, last stream id) atomically replaces the old one.
    Recovery truncates the open shard to the checkpoint's offset and deletes shards a crashed roll
    opened after it: a batch written but not checkpointed is written again, never twice.
    """

    def __init__(self, dataset_dir: Path, shard_rows: int) -> None:
        self.dir = dataset_dir
        self.shard_rows = shard_rows
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise output_error(self.dir, exc) from None
        self.cp = self._load_checkpoint()

    @property
    def last_id(self) -> str:
        return self.cp.last_id

    @property
    def rows(self) -> int:
        return self.cp.rows

    def _load_checkpoint(self) -> Checkpoint:
        path = self.dir / CHECKPOINT
        if not path.exists():
            return Checkpoint()
        return Checkpoint(**json.loads(path.read_text()))

    def recover(self) -> None:
        try:
            path = shard_path(self.dir, self.cp.shard)
            if path.exists() and path.stat().st_size > self.cp.offset:
                log.warning("%s: truncating %s to checkpoint (%d bytes)", self.dir.name, path.name, self.cp.offset)
                with path.open("r+b") as fh:
                    fh.truncate(self.cp.offset)
                    os.fsync(fh.fileno())
            for stale in self.dir.glob("shard-*.jsonl"):
                if _shard_number(stale) > self.cp.shard:
                    log.warning("%s: removing %s, opened after the checkpoint", self.dir.name, stale.name)
                    stale.unlink()
        except OSError as exc:
            raise output_error(self.dir, exc) from None

    def write(self, rows: Sequence[dict[str, Any]], last_id: str) -> None:
        # The new checkpoint is built aside and adopted only once it is on disk: a failed write
        # leaves this object (and the disk, after recover) at the last durable position.
        cp = self.cp
        lines = [jsonl_line(r) for r in rows]
        path = shard_path(self.dir, cp.shard)
        try:
            while lines:
                room = self.shard_rows - cp.rows_in_shard
                if room <= 0:
                    cp = replace(cp, shard=cp.shard + 1, offset=0, rows_in_shard=0)
                    room = self.shard_rows
                chunk, lines = lines[:room], lines[room:]
                path = shard_path(self.dir, cp.shard)
                # At the checkpoint's offset, not appended: bytes a failed write left behind
                # are overwritten, so writing a batch again never writes it twice.
                with path.open("r+b" if path.exists() else "wb") as fh:
                    fh.seek(cp.offset)
                    fh.write(b"".join(chunk))
                    fh.truncate()
                    fh.flush()
                    os.fsync(fh.fileno())
                    cp = replace(cp, offset=fh.tell(), rows_in_shard=cp.rows_in_shard + len(chunk))
            cp = replace(cp, rows=cp.rows + len(rows), last_id=last_id)
            path = self.dir / CHECKPOINT
            self._save_checkpoint(cp)
        except OSError as exc:
            raise output_error(path, exc) from None
        self.cp = cp

    def _save_checkpoint(self, cp: Checkpoint) -> None:
        tmp = self.dir / (CHECKPOINT + ".tmp")
        tmp.write_text(json.dumps(asdict(cp)))
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / CHECKPOINT)
        _fsync_dir(self.dir)

    def iter_kept(self) -> Iterator[dict[str, Any]]:
        for shard in range(self.cp.shard + 1):
            path = shard_path(self.dir, shard)
            if not path.exists():
                continue
            end = self.cp.offset if shard == self.cp.shard else None
            read = 0
            with path.open("rb") as fh:
                for line in fh:
                    read += len(line)
                    if end is not None and read > end:
                        break
                    if line.strip():
                        yield json.loads(line)

    def files(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob("shard-*.jsonl") if _shard_number(p) <= self.cp.shard)


#: Output formats by name: a new one is a class with RowWriter's methods and a line here.
ROW_FORMATS: dict[str, Callable[[Path, int], RowWriter]] = {"jsonl": JsonlShards}


def open_writer(dataset_dir: Path, shard_rows: int, fmt: str = "jsonl") -> RowWriter:
    """The writer for one dataset's folder, recovered to its last durable position."""
    writer = ROW_FORMATS[fmt](dataset_dir, shard_rows)
    writer.recover()
    return writer
