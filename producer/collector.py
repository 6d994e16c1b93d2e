"""Results stream → JSONL shards on disk, each kept row exactly once, whatever crashes.

Per dataset the collector appends a batch of rows to the open shard, fsyncs it, then atomically
replaces ``.checkpoint.json`` (shard, byte offset, rows in shard, last stream id). On start it
truncates the shard back to the checkpoint and reads the stream after ``last_id``: a batch written
but not checkpointed is written again, never twice. Budget.lua XADDs a row only once per prompt, so
the stream itself holds no duplicates.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis

from common.keys import COLLECTOR_FENCE, DatasetKeys
from common.redis_client import WAITAOF_TIMEOUT_MS, fence_failed

log = logging.getLogger(__name__)

CHECKPOINT = ".checkpoint.json"
BATCH_ROWS = 500


@dataclass
class Checkpoint:
    shard: int = 0
    offset: int = 0
    rows_in_shard: int = 0
    last_id: str = "0-0"
    rows: int = 0


# Characters str.splitlines() (and some JSONL readers) treat as line breaks, which JSON may carry
# raw inside strings: escaped, a row is one line for every reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _jsonl_line(row: dict[str, Any]) -> bytes:
    text = json.dumps(row, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return text.encode() + b"\n"


def shard_path(dataset_dir: Path, shard: int) -> Path:
    return dataset_dir / f"shard-{shard:05d}.jsonl"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DatasetSink:
    """The on-disk side of one dataset: shards plus checkpoint."""

    def __init__(self, dataset: str, out_dir: Path, shard_rows: int) -> None:
        self.dataset = dataset
        self.keys = DatasetKeys(dataset)
        self.dir = out_dir / dataset
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_rows = shard_rows
        self.cp = self._load_checkpoint()
        self._recover()

    def _load_checkpoint(self) -> Checkpoint:
        path = self.dir / CHECKPOINT
        if not path.exists():
            return Checkpoint()
        return Checkpoint(**json.loads(path.read_text()))

    def _recover(self) -> None:
        """Cut off whatever a crash left after the last checkpoint."""
        path = shard_path(self.dir, self.cp.shard)
        if path.exists() and path.stat().st_size > self.cp.offset:
            log.warning("%s: truncating %s to checkpoint (%d bytes)", self.dataset, path.name, self.cp.offset)
            with path.open("r+b") as fh:
                fh.truncate(self.cp.offset)
                os.fsync(fh.fileno())
        for stale in self.dir.glob("shard-*.jsonl"):
            if int(stale.stem.split("-")[1]) > self.cp.shard:
                stale.unlink()  # opened by a crashed roll before its checkpoint landed

    def write(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> int:
        """Append one batch (stream entries) and checkpoint it; returns rows written."""
        if not entries:
            return 0
        lines: list[bytes] = []
        for _, fields in entries:
            row: dict[str, Any] = msgpack.unpackb(fields[b"row"], raw=False)
            lines.append(_jsonl_line(row))
        written = 0
        while lines:
            room = self.shard_rows - self.cp.rows_in_shard
            if room <= 0:
                self.cp.shard, self.cp.offset, self.cp.rows_in_shard = self.cp.shard + 1, 0, 0
                room = self.shard_rows
            chunk, lines = lines[:room], lines[room:]
            with shard_path(self.dir, self.cp.shard).open("ab") as fh:
                fh.write(b"".join(chunk))
                fh.flush()
                os.fsync(fh.fileno())
                self.cp.offset = fh.tell()
            self.cp.rows_in_shard += len(chunk)
            written += len(chunk)
        self.cp.rows += written
        self.cp.last_id = entries[-1][0].decode()
        self._save_checkpoint()
        return written

    def _save_checkpoint(self) -> None:
        tmp = self.dir / (CHECKPOINT + ".tmp")
        tmp.write_text(json.dumps(self.cp.__dict__))
        with tmp.open("rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / CHECKPOINT)
        _fsync_dir(self.dir)


class Collector:
    """One thread draining the results streams of every open dataset."""

    def __init__(self, client: redis.Redis, out_dir: Path, shard_rows: int) -> None:
        self._client = client
        self._out_dir = out_dir
        self._shard_rows = shard_rows
        self._sinks: dict[str, DatasetSink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def add(self, dataset: str) -> DatasetSink:
        with self._lock:
            sink = self._sinks.get(dataset)
            if sink is None:
                sink = self._sinks[dataset] = DatasetSink(dataset, self._out_dir, self._shard_rows)
            return sink

    def drain_once(self, block_ms: int | None = 500) -> int:
        """Move one batch per stream to disk; ``block_ms=None`` returns at once (0 would block forever)."""
        with self._lock:
            sinks = list(self._sinks.values())
        if not sinks:
            return 0
        streams = {s.keys.results: s.cp.last_id for s in sinks}
        # Rows go to disk only once they are fsynced in Redis' AOF: a row read just before the Redis
        # host crashed and lost it would be settled again by its worker and land in the shard
        # twice. WAITAOF waits for this client's own writes, so the INCR puts the rows just read
        # behind the fence; one pipeline, so a retry after a broken connection reads again from the
        # restarted server.
        pipe = self._client.pipeline(transaction=False)
        pipe.xread(streams, count=BATCH_ROWS, block=block_ms)
        pipe.incr(COLLECTOR_FENCE)
        pipe.execute_command("WAITAOF", 1, 0, WAITAOF_TIMEOUT_MS)
        reply, _, synced = pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise reply
        if fence_failed(synced):
            raise synced
        reply = reply or []
        by_stream = {s.keys.results: s for s in sinks}
        total = 0
        for stream, entries in reply:
            sink = by_stream[stream.decode() if isinstance(stream, bytes) else stream]
            total += sink.write(entries)
            # Entries up to the checkpoint are on disk: Redis need not hold them any more.
            self._client.xtrim(sink.keys.results, minid=sink.cp.last_id, approximate=False)
        return total

    def pending(self, dataset: str) -> int:
        """Rows in the stream not yet on disk (the entry at last_id itself is kept by XTRIM)."""
        sink = self._sinks[dataset]
        return len(self._client.xrange(sink.keys.results, min="(" + sink.cp.last_id, count=1))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="collector", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.drain_once()
        except redis.ConnectionError as exc:  # past the retry window: one line, the run loop says it
            self.error = exc
            log.error("collector stopped: %s", exc)
        except BaseException as exc:  # surfaced to the run loop, which stops the run
            self.error = exc
            log.exception("collector stopped")

    def stop(self) -> None:
        """Stop the thread after its current batch, then write whatever is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        while self.error is None and self.drain_once(block_ms=None):
            pass
