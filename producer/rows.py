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

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import orjson

from common import files
from common.errors import OutputError, ProducerFenced
from common.quality import is_degenerate

log = logging.getLogger(__name__)

CHECKPOINT = ".checkpoint.json"
#: ``[request] truncated = "separate"``: rows cut by max_tokens, full, beside the shards.
TRUNCATED_FILE = "truncated.jsonl"
#: ``[request] degenerate = "separate"``: rows marked degenerate (``quality``), full, beside the shards.
DEGENERATE_FILE = "degenerate.jsonl"
#: ``truncated = "drop"`` (or ``degenerate = "drop"``): one stub per dropped row (its id, tokens,
#: cost, provider: no text, no ids), so a resumed run counts it as kept (billed is billed) and never asks for it again.
DROPPED_FILE = "dropped.jsonl"
#: What a dropped row's stub keeps.
STUB_FIELDS = ("id", "key", "turn", "where", "finish_reason", "num_tokens", "usage", "provider", "quantization",
               "model", "generation_id", "manifest", "conversation_end", "quality", "sampling")
#: Held (flock) by a writer around each batch and its checkpoint, and around recovery.
FOLDER_LOCK = ".lock"
#: How often a writer waiting for the folder's lock says so.
FOLDER_LOCK_NOTICE_S = 10.0
#: Held by every batch write of this process: ``stop_writing`` takes it for good before a hard exit.
_WRITING = threading.Lock()


def stop_writing(timeout_s: float) -> bool:
    """No batch of this process is half written once this returns True, and none starts after:
    for a process that must exit at once (``os._exit``) without leaving a torn line."""
    return _WRITING.acquire(timeout=timeout_s)


class Fence(Protocol):
    """The producer lock's token as a writer checks it (``producer/lock.py``)."""

    @property
    def generation(self) -> int: ...

    @property
    def owner(self) -> str: ...


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

    def write(self, rows: Sequence[dict[str, Any]], last_id: str, ids: Sequence[str] | None = None) -> None:
        """Make ``rows`` and the stream position ``last_id`` durable together. ``ids``: each row's
        stream id; rows another producer wrote meanwhile (at or before its position) are skipped."""

    def iter_kept(self) -> Iterator[dict[str, Any]]:
        """The durable rows, in the order they were written."""

    def files(self) -> list[str]:
        """Names of the files holding the rows (for the summary)."""


def output_error(path: Path, exc: OSError) -> OutputError:
    return OutputError(f"cannot write {path}: {exc.strerror or exc}; rows not yet written wait in Redis: "
                       "free the output folder, then run the same command again")


def atomic_write(path: Path, text: str) -> None:
    """Write a whole small file (summary, failures) so a reader never sees half of it."""
    try:
        files.atomic_write(path, text.encode("utf-8"))
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
    #: The producer lock's generation and owner that wrote it (0, "": a writer without a lock).
    generation: int = 0
    owner: str = ""
    #: Durable bytes and rows of truncated.jsonl and dropped.jsonl (part of ``rows``).
    truncated_offset: int = 0
    truncated_rows: int = 0
    dropped_offset: int = 0
    dropped_rows: int = 0
    #: Durable bytes and rows of degenerate.jsonl (part of ``rows``).
    degenerate_offset: int = 0
    degenerate_rows: int = 0


def stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def disk_generation(dataset_dir: Path) -> int:
    """The producer generation that last wrote ``dataset_dir`` (0 if none)."""
    try:
        return int(json.loads((dataset_dir / CHECKPOINT).read_text()).get("generation", 0))
    except (OSError, ValueError):
        return 0


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


def is_truncated(row: dict[str, Any]) -> bool:
    """Cut by max_tokens: the answer never reached its end."""
    return row.get("finish_reason") == "length"


def dropped_stub(row: dict[str, Any]) -> dict[str, Any]:
    """A dropped row as ``dropped.jsonl`` keeps it. A regenerated turn keeps its message (the
    conversation's history for a resumed run), nothing else of its text."""
    stub = {k: row[k] for k in STUB_FIELDS if k in row}
    if "key" in row:
        stub["conversations"] = row["conversations"][-1:]
    return stub


def _write_at(path: Path, offset: int, data: bytes) -> int:
    """``data`` at ``offset`` (what a failed write left after it is overwritten), fsynced; the new end."""
    with path.open("r+b" if path.exists() else "wb") as fh:
        fh.seek(offset)
        fh.write(data)
        fh.truncate()
        fh.flush()
        os.fsync(fh.fileno())
        return fh.tell()


def _cut_to(path: Path, offset: int) -> None:
    if path.exists() and path.stat().st_size > offset:
        log.warning("%s: truncating %s to checkpoint (%d bytes)", path.parent.name, path.name, offset)
        with path.open("r+b") as fh:
            fh.truncate(offset)
            os.fsync(fh.fileno())


def _read_rows(path: Path, end: int | None) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file up to byte ``end`` (None: all)."""
    if not path.exists():
        return
    read = 0
    with path.open("rb") as fh:
        for line in fh:
            read += len(line)
            if end is not None and read > end:
                break
            if line.strip():
                yield json.loads(line)


def shard_path(dataset_dir: Path, shard: int) -> Path:
    return dataset_dir / f"shard-{shard:05d}.jsonl"


def _shard_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


class JsonlShards:
    """``shard-NNNNN.jsonl`` files of ``shard_rows`` rows each, plus ``.checkpoint.json``.

    A batch is appended to the open shard (rolling to new ones as they fill) and fsynced, then the
    checkpoint (shard, byte offset, rows in shard, last stream id) atomically replaces the old one.
    Recovery truncates the open shard to the checkpoint's offset and deletes shards a crashed roll
    opened after it: a batch written but not checkpointed is written again, never twice. A write
    that fails (disk full) cuts the shard back to the checkpoint's offset at once, so a reader of
    the folder never meets a torn last line.

    Two producers may meet in one folder (one paused past its lock's TTL, another started): each
    batch and recovery hold an exclusive ``flock`` of ``.lock`` and read the checkpoint from disk
    first. A checkpoint of a newer lock generation than ``fence``'s refuses the write
    (``ProducerFenced``); one that moved past this writer's (an older producer wrote) is adopted,
    and the batch's rows at or before its position are skipped: no interleaving loses or repeats a row.
    """

    def __init__(self, dataset_dir: Path, shard_rows: int, fence: Fence | None = None,
                 truncated: str = "keep", degenerate: str = "keep") -> None:
        """``truncated``: where rows cut by max_tokens go (``[request] truncated``): ``keep`` in the
        shards, ``separate`` in truncated.jsonl, ``drop`` as stubs in dropped.jsonl; ``degenerate``
        the same for rows marked degenerate (``[request] degenerate``, degenerate.jsonl). A row both
        cut and degenerate goes the stricter way (drop, then apart: truncated.jsonl when that policy
        sets cut rows apart). Each batch's rows, wherever they go, are durable with its one checkpoint."""
        self.dir = dataset_dir
        self.shard_rows = shard_rows
        self.fence = fence
        self.truncated = truncated
        self.degenerate = degenerate
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

    @contextlib.contextmanager
    def _folder_lock(self) -> Iterator[None]:
        """The folder to ourselves: a writer frozen mid-batch holds it, and the other waits, so
        neither sees half of the other's batch."""
        try:
            fd = os.open(self.dir / FOLDER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise output_error(self.dir / FOLDER_LOCK, exc) from None
        try:
            waited_s = 0.0
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if waited_s and waited_s % FOLDER_LOCK_NOTICE_S < 0.1:
                        log.warning("%s: waiting %.0f s for the folder's lock (another specfleet process writes "
                                    "here, or is paused while writing)", self.dir.name, waited_s)
                    time.sleep(0.1)
                    waited_s = round(waited_s + 0.1, 1)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _check_fence(self, disk: Checkpoint) -> None:
        if self.fence is None:
            return
        mine = (self.fence.generation, self.fence.owner)
        if disk.generation > mine[0] or (disk.generation == mine[0] and disk.owner and disk.owner != mine[1]):
            raise ProducerFenced(
                f"{self.dir}: written by another producer ({disk.owner}, generation {disk.generation}) since this "
                f"one (generation {mine[0]}) was paused or cut off; this one writes nothing more and stops")

    def _sync_with_disk(self) -> Checkpoint:
        """The checkpoint on disk (under the folder's lock), refused if a newer producer wrote it."""
        disk = self._load_checkpoint()
        self._check_fence(disk)
        if disk != self.cp:
            if disk.rows != self.cp.rows or disk.last_id != self.cp.last_id:
                log.warning("%s: another producer wrote rows here meanwhile (%d rows, up to %s): going on from there",
                            self.dir.name, disk.rows, disk.last_id)
            self.cp = disk
        return disk

    def recover(self) -> None:
        with self._folder_lock():
            self.cp = self._load_checkpoint()
            self._recover()

    def _recover(self) -> None:
        try:
            _cut_to(shard_path(self.dir, self.cp.shard), self.cp.offset)
            _cut_to(self.dir / TRUNCATED_FILE, self.cp.truncated_offset)
            _cut_to(self.dir / DROPPED_FILE, self.cp.dropped_offset)
            _cut_to(self.dir / DEGENERATE_FILE, self.cp.degenerate_offset)
            for stale in self.dir.glob("shard-*.jsonl"):
                if _shard_number(stale) > self.cp.shard:
                    log.warning("%s: removing %s, opened after the checkpoint", self.dir.name, stale.name)
                    stale.unlink()
        except OSError as exc:
            raise output_error(self.dir, exc) from None

    def write(self, rows: Sequence[dict[str, Any]], last_id: str, ids: Sequence[str] | None = None) -> None:
        with self._folder_lock():
            disk = self._sync_with_disk()
            if ids and stream_id(ids[0]) <= stream_id(disk.last_id):
                after = stream_id(disk.last_id)
                first = next((i for i, sid in enumerate(ids) if stream_id(sid) > after), len(ids))
                rows = rows[first:]  # written by the other producer already
            if stream_id(last_id) <= stream_id(disk.last_id):
                return
            with _WRITING:
                self._write(rows, last_id)

    def _write(self, rows: Sequence[dict[str, Any]], last_id: str) -> None:
        # The new checkpoint is built aside and adopted only once it is on disk: a failed write
        # leaves this object, and the disk, at the last durable position.
        cp = self.cp
        if self.fence is not None:
            cp = replace(cp, generation=self.fence.generation, owner=self.fence.owner)
        placed = _place(rows, self.truncated, self.degenerate)
        lines = [jsonl_line(r) for r in placed[None]]
        path = shard_path(self.dir, cp.shard)
        try:
            if cut := placed[TRUNCATED_FILE]:
                path = self.dir / TRUNCATED_FILE
                end = _write_at(path, cp.truncated_offset, b"".join(jsonl_line(r) for r in cut))
                cp = replace(cp, truncated_offset=end, truncated_rows=cp.truncated_rows + len(cut))
            if apart := placed[DEGENERATE_FILE]:
                path = self.dir / DEGENERATE_FILE
                end = _write_at(path, cp.degenerate_offset, b"".join(jsonl_line(r) for r in apart))
                cp = replace(cp, degenerate_offset=end, degenerate_rows=cp.degenerate_rows + len(apart))
            if dropped := placed[DROPPED_FILE]:
                path = self.dir / DROPPED_FILE
                end = _write_at(path, cp.dropped_offset, b"".join(jsonl_line(dropped_stub(r)) for r in dropped))
                cp = replace(cp, dropped_offset=end, dropped_rows=cp.dropped_rows + len(dropped))
            while lines:
                room = self.shard_rows - cp.rows_in_shard
                if room <= 0:
                    cp = replace(cp, shard=cp.shard + 1, offset=0, rows_in_shard=0)
                    room = self.shard_rows
                chunk, lines = lines[:room], lines[room:]
                path = shard_path(self.dir, cp.shard)
                # At the checkpoint's offset, not appended: bytes a failed write left behind
                # are overwritten, so writing a batch again never writes it twice.
                end = _write_at(path, cp.offset, b"".join(chunk))
                cp = replace(cp, offset=end, rows_in_shard=cp.rows_in_shard + len(chunk))
            cp = replace(cp, rows=cp.rows + len(rows), last_id=last_id)
            path = self.dir / CHECKPOINT
            self._save_checkpoint(cp)
        except OSError as exc:
            self._cut_back()
            raise output_error(path, exc) from None
        self.cp = cp

    def _cut_back(self) -> None:
        """After a failed write: the shards as the checkpoint has them (a full disk still lets a
        file shrink). Best effort: what is left here, recovery cuts off on the next start."""
        with contextlib.suppress(OSError, ValueError, OutputError):
            # The disk's checkpoint, not ours: the failure may have come after it was replaced.
            self.cp = self._load_checkpoint()
            self._recover()

    def _save_checkpoint(self, cp: Checkpoint) -> None:
        files.atomic_write(self.dir / CHECKPOINT, json.dumps(asdict(cp)).encode())

    def iter_kept(self) -> Iterator[dict[str, Any]]:
        """The shards' rows, then truncated.jsonl's and dropped.jsonl's stubs (the budget kept them all)."""
        for shard in range(self.cp.shard + 1):
            yield from _read_rows(shard_path(self.dir, shard), self.cp.offset if shard == self.cp.shard else None)
        yield from _read_rows(self.dir / TRUNCATED_FILE, self.cp.truncated_offset)
        yield from _read_rows(self.dir / DEGENERATE_FILE, self.cp.degenerate_offset)
        yield from _read_rows(self.dir / DROPPED_FILE, self.cp.dropped_offset)

    def files(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob("shard-*.jsonl") if _shard_number(p) <= self.cp.shard)


def place_of(row: dict[str, Any], truncated: str, degenerate: str) -> str | None:
    """Where a row goes under the two policies: None (the shards), ``TRUNCATED_FILE``,
    ``DEGENERATE_FILE`` or ``DROPPED_FILE`` (a stub)."""
    cut, bad = is_truncated(row), is_degenerate(row)
    if (cut and truncated == "drop") or (bad and degenerate == "drop"):
        return DROPPED_FILE
    if cut and truncated == "separate":
        return TRUNCATED_FILE
    if bad and degenerate == "separate":
        return DEGENERATE_FILE
    return None


def _place(rows: Sequence[dict[str, Any]], truncated: str, degenerate: str) -> dict[str | None, list[dict[str, Any]]]:
    placed: dict[str | None, list[dict[str, Any]]] = {place: [] for place in
                                                      (None, TRUNCATED_FILE, DEGENERATE_FILE, DROPPED_FILE)}
    for row in rows:
        placed[place_of(row, truncated, degenerate)].append(row)
    return placed


#: Output formats by name: a new one is a class with RowWriter's methods and a line here.
ROW_FORMATS: dict[str, Callable[[Path, int, Fence | None, str, str], RowWriter]] = {"jsonl": JsonlShards}


def open_writer(dataset_dir: Path, shard_rows: int, fmt: str = "jsonl", fence: Fence | None = None,
                truncated: str = "keep", degenerate: str = "keep") -> RowWriter:
    """The writer for one dataset's folder, recovered to its last durable position; ``fence``: the
    producer lock whose generation the writer checks and records; ``truncated`` and ``degenerate``:
    the policies for rows cut by max_tokens and rows marked degenerate."""
    writer = ROW_FORMATS[fmt](dataset_dir, shard_rows, fence, truncated, degenerate)
    writer.recover()
    return writer
