"""Results streams → each dataset's ``RowWriter`` (``producer/rows.py``), each kept row exactly once.

Per dataset the collector reads a batch after the writer's durable position (``last_id``), hands
it to the writer (rows and position become durable together), and only then trims the stream up to
that position. A crash or a refused write before the position is durable leaves the rows in Redis,
and the next start reads them again. Budget.lua XADDs a row only once per prompt, so the stream
itself holds no duplicates.

The collector's writes are fenced by the producer lock (``producer/lock.py``): the writer checks its
generation against the folder's checkpoint, and the trim runs only while the lock is ours. A
collector thread that resumes after its producer was paused past the lock's TTL, with another
producer running, writes nothing: it stops with ``ProducerFenced``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, overload

import msgpack
import redis

from common.budget import Budget
from common.errors import OutputError, ProducerFenced, RedisRefusesWrites
from common.keys import COLLECTOR_FENCE, DatasetKeys
from common.redis_client import fence_command, fence_failed
from producer.rows import Fence, RowWriter, open_writer

log = logging.getLogger(__name__)

BATCH_ROWS = 2000
#: A row's manifest key as msgpack writes it (a fixstr), followed by its value.
_MANIFEST_KEY = b"\xa8manifest"
#: A batch costs two fsyncs, a checkpoint rename and a WAITAOF whatever its size: the collector
#: writes at most this often (unless a read came back full), so a busy run writes a few large
#: batches a second instead of one per handful of rows. Rows reach disk at most this much later.
WRITE_EVERY_S = 0.5


class FencedWriter(Fence, Protocol):
    """The producer lock: its token for the writer, and its fenced Redis writes."""

    def write(self, *commands: Sequence[Any]) -> list[Any]: ...


class DatasetSink:
    """One dataset's results stream and the writer its rows go to."""

    def __init__(self, dataset: str, writer: RowWriter) -> None:
        self.dataset = dataset
        self.keys = DatasetKeys(dataset)
        self.writer = writer

    def write(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> int:
        """Write one batch of stream entries durably; returns rows written."""
        if not entries:
            return 0
        rows = UnpackedRows([fields[b"row"] for _, fields in entries])
        self.writer.write(rows, entries[-1][0].decode(), [sid.decode() for sid, _ in entries])
        return len(rows)


class UnpackedRows(Sequence[dict[str, Any]]):
    """A batch's msgpack rows, each unpacked when the writer reaches it.

    Unpacked all at once, a batch of 2,000 rows of a few thousand ids is millions of fresh int
    objects (tens of MB the allocator must fault in, then hands back): that cost more than the
    decoding itself. Unpacked one at a time, each row's objects are freed before the next is made.
    """

    def __init__(self, packed: list[bytes]) -> None:
        self._packed = packed

    def __len__(self) -> int:
        return len(self._packed)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [_unpack(p) for p in self._packed[index]]
        return _unpack(self._packed[index])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return map(_unpack, self._packed)


def _unpack(packed: bytes) -> dict[str, Any]:
    row: dict[str, Any] = msgpack.unpackb(packed, raw=False)
    return row


class Collector:
    """One thread draining the results streams of every open dataset."""

    def __init__(self, client: redis.Redis, out_dir: Path, shard_rows: int, row_format: str = "jsonl",
                 fence: FencedWriter | None = None, truncated: str = "keep", degenerate: str = "keep") -> None:
        """``fence``: the producer lock (tests and benches may run a collector without one);
        ``truncated``: where rows cut by max_tokens go (``[request] truncated``); ``degenerate``:
        where rows marked degenerate go (``[request] degenerate``)."""
        self._truncated = truncated
        self._degenerate = degenerate
        self._client = client
        self._fence = fence
        self._out_dir = out_dir
        self._shard_rows = shard_rows
        self._row_format = row_format
        self._sinks: dict[str, DatasetSink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: Cuts the wait between writes short: stopping, or someone waiting for the last rows.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._manifest_marks: tuple[bytes, ...] = ()

    def accept_manifests(self, manifests: Collection[str]) -> None:
        """Write only rows made under one of ``manifests`` (the folder's): a row of another (a killed
        run of another config, still settling what it had in flight) is deleted and uncounted, its
        prompt asked again (``Budget.drop_rows``). Rows naming no manifest are written."""
        self._manifest_marks = tuple(_MANIFEST_KEY + msgpack.packb(m) for m in sorted(manifests))

    def _foreign(self, packed: bytes) -> bool:
        # A byte search first (rows are tens of KB, and all but a stray few are the run's); an
        # unpack only to be sure of one that looks foreign.
        if not self._manifest_marks or _MANIFEST_KEY not in packed:
            return False
        if any(mark in packed for mark in self._manifest_marks):
            return False
        manifest = _unpack(packed).get("manifest")
        return manifest is not None and _MANIFEST_KEY + msgpack.packb(manifest) not in self._manifest_marks

    def _drop_foreign(self, dataset: str, entries: list[tuple[bytes, dict[bytes, bytes]]]
                      ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        foreign = [(sid, f) for sid, f in entries if self._foreign(f[b"row"])]
        if not foreign:
            return entries
        rows = [(sid.decode(), f[b"id"].decode(), int(_unpack(f[b"row"]).get("num_tokens") or 0)) for sid, f in foreign]
        dropped = Budget(self._client, dataset).drop_rows(rows)
        log.warning("%s: %d rows made under a manifest this folder does not hold (a run of another config, "
                    "killed, still settling its last requests) left out: their prompts are asked again",
                    dataset, dropped)
        gone = {sid for sid, _ in foreign}
        return [(sid, f) for sid, f in entries if sid not in gone]

    def add(self, dataset: str) -> DatasetSink:
        with self._lock:
            sink = self._sinks.get(dataset)
            if sink is None:
                writer = open_writer(self._out_dir / dataset, self._shard_rows, self._row_format, self._fence,
                                     self._truncated, self._degenerate)
                sink = self._sinks[dataset] = DatasetSink(dataset, writer)
            return sink

    def drain_once(self, block_ms: int | None = 500) -> int:
        """Move one batch per stream to disk; ``block_ms=None`` returns at once (0 would block forever)."""
        with self._lock:
            sinks = list(self._sinks.values())
        if not sinks:
            return 0
        streams = {s.keys.results: s.writer.last_id for s in sinks}
        # Rows go to disk only once they are fsynced in Redis' AOF: a row read just before the Redis
        # host crashed and lost it would be settled again by its worker and land in the shard
        # twice. WAITAOF waits for this client's own writes, so the INCR puts the rows just read
        # behind the fence; one pipeline, so a retry after a broken connection reads again from the
        # restarted server.
        pipe = self._client.pipeline(transaction=False)
        pipe.xread(streams, count=BATCH_ROWS, block=block_ms)
        pipe.incr(COLLECTOR_FENCE)
        pipe.execute_command(*fence_command(pipe))
        read, _, synced = pipe.execute(raise_on_error=False)
        if isinstance(read, Exception):
            raise read
        if fence_failed(synced):
            raise synced
        reply = read or []
        by_stream = {s.keys.results: s for s in sinks}
        total = 0
        for stream, entries in reply:
            sink = by_stream[stream.decode() if isinstance(stream, bytes) else stream]
            total += sink.write(self._drop_foreign(sink.dataset, entries))
            # Entries up to the checkpoint are on disk: Redis need not hold them any more. Fenced: a
            # stale producer's trim could drop rows the producer now holding the lock has not written.
            if self._fence is not None:
                self._fence.write(("XTRIM", sink.keys.results, "MINID", sink.writer.last_id))
            else:
                self._client.xtrim(sink.keys.results, minid=sink.writer.last_id, approximate=False)
        return total

    def pending(self, dataset: str) -> int:
        """Rows in the stream not yet on disk (the entry at last_id itself is kept by XTRIM)."""
        sink = self._sinks[dataset]
        pending = len(self._client.xrange(sink.keys.results, min="(" + sink.writer.last_id, count=1))
        if pending:
            self._wake.set()  # the run waits for these rows to end the dataset: write them now
        return pending

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="collector", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                if self.drain_once() >= BATCH_ROWS:
                    continue  # more is waiting: read on at once
                self._wake.wait(WRITE_EVERY_S - (time.monotonic() - started))
                self._wake.clear()
        except (OutputError, ProducerFenced, RedisRefusesWrites) as exc:  # the run stops with this one line
            self.error = exc
        except redis.ConnectionError as exc:  # past the retry window: one line, the run loop says it
            self.error = exc
            log.error("collector stopped: %s", exc)
        except BaseException as exc:  # surfaced to the run loop, which stops the run
            self.error = exc
            log.exception("collector stopped")

    def stop(self, *, drain: bool = True) -> None:
        """Stop the thread after its current batch, then write whatever is left (``drain``: not
        for a producer that lost the lock, or that stops while Redis is away)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        while drain and self.error is None and self.drain_once(block_ms=None):
            pass
