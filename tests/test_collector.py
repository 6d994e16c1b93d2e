"""Rows reach disk exactly once: a crash between writing and checkpointing writes nothing twice."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import msgpack
import pytest
import redis

from common.budget import Ask, Budget
from common.errors import OutputError
from producer.collector import Collector
from producer.rows import CHECKPOINT, JsonlShards, open_writer, shard_path


def _keep(b: Budget, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        pid = f"p{i}"
        b.reserve(pid, "L", ttl_ms=60_000, ask=Ask(3, 0, 3))
        b.settle(pid, "L", 3, msgpack.packb({"id": pid, "num_tokens": 3, "text": "héllo ✓"}), cost_usd=0.0)


def _ids(out: Path) -> list[str]:
    return [json.loads(x)["id"] for p in sorted((out / "D").glob("shard-*.jsonl")) for x in p.read_text().splitlines()]


def test_rows_are_sharded_and_trimmed_from_redis(tmp_path: Path, redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "D")
    b.open(10_000)
    _keep(b, 25)
    c = Collector(redis_client, tmp_path, shard_rows=10)
    c.add("D")
    while c.drain_once(block_ms=10):
        pass
    assert _ids(tmp_path) == [f"p{i}" for i in range(25)]
    assert [p.name for p in sorted((tmp_path / "D").glob("shard-*"))] == [
        "shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    assert redis_client.xlen(b.keys.results) <= 1  # the rest is on disk, not in Redis memory
    assert c.pending("D") == 0


def test_crash_after_write_before_checkpoint_writes_nothing_twice(tmp_path: Path, redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "D")
    b.open(10_000)
    _keep(b, 5)
    c = Collector(redis_client, tmp_path, shard_rows=100)
    c.add("D")
    c.drain_once(block_ms=10)
    _keep(b, 5, start=5)
    # Simulate the crash: the next batch reached the shard, its checkpoint did not.
    checkpoint = json.loads((tmp_path / "D" / CHECKPOINT).read_text())
    with shard_path(tmp_path / "D", 0).open("ab") as fh:
        fh.write(b'{"id": "p5", "partial": tr')
    restarted = Collector(redis_client, tmp_path, shard_rows=100)
    restarted.add("D")
    assert shard_path(tmp_path / "D", 0).stat().st_size == checkpoint["offset"]
    while restarted.drain_once(block_ms=10):
        pass
    assert _ids(tmp_path) == [f"p{i}" for i in range(10)]


def test_a_row_is_one_line_for_every_reader(tmp_path: Path, redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "D")
    b.open(10_000)
    tricky = "line\u2028sep\u2029para\x85nel é ✓ 🙂"
    b.reserve("p", "L", ttl_ms=60_000, ask=Ask(3, 0, 3))
    b.settle("p", "L", 3, msgpack.packb({"id": "p", "content": tricky}), cost_usd=0.0)
    c = Collector(redis_client, tmp_path, shard_rows=10)
    c.add("D")
    c.drain_once(block_ms=10)
    text = shard_path(tmp_path / "D", 0).read_text(encoding="utf-8")
    assert len(text.splitlines()) == 1  # splitlines() breaks at U+2028/2029/0085 when they are raw
    assert json.loads(text)["content"] == tricky


def test_rows_land_with_the_values_they_were_settled_with(tmp_path: Path, redis_client: redis.Redis) -> None:
    """Compact JSON, one row per line, every value as the worker packed it; a row orjson refuses
    (nested deeper than its limit of 255) is written all the same."""
    b = Budget(redis_client, "D")
    b.open(10_000)
    deep: dict[str, object] = {"leaf": [1, 2.5]}
    for _ in range(300):
        deep = {"x": deep}
    rows = [
        {"id": "p0", "input_ids": [0, 151_643, 2**63 - 1], "loss_mask": [0, 1, 1], "num_tokens": 2,
         "usage": {"cost": 1e-05, "prompt_tokens": 1}, "conversations": [{"role": "user", "content": "é \"q\" \\ ✓"}],
         "engine_check": None, "flag": True},
        {"id": "p1", "tools": [deep]},
    ]
    for row in rows:
        b.reserve(row["id"], "L", ttl_ms=60_000, ask=Ask(3, 0, 3))
        b.settle(row["id"], "L", 3, msgpack.packb(row, use_bin_type=True), cost_usd=0.0)
    c = Collector(redis_client, tmp_path, shard_rows=10)
    c.add("D")
    c.drain_once(block_ms=10)
    lines = shard_path(tmp_path / "D", 0).read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x) for x in lines[:-1]] == rows
    assert lines[0].startswith(b'{"id":"p0","input_ids":[0,151643,') and "é".encode() in lines[0]


def _refuse_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(self: JsonlShards, cp: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(JsonlShards, "_save_checkpoint", full)


class _Crash(BaseException):
    """The process dying at that point: no handler runs (an OSError would be cut back at once)."""


def _crash_at_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(self: JsonlShards, cp: object) -> None:
        raise _Crash

    monkeypatch.setattr(JsonlShards, "_save_checkpoint", crash)


def test_crash_during_a_shard_roll_loses_and_duplicates_nothing(
    tmp_path: Path, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Budget(redis_client, "D")
    b.open(10_000)
    _keep(b, 10)
    c = Collector(redis_client, tmp_path, shard_rows=10)
    c.add("D")
    c.drain_once(block_ms=10)  # shard 0 is full and checkpointed
    _keep(b, 5, start=10)
    with monkeypatch.context() as m:
        _crash_at_checkpoints(m)  # the next batch opens shard 1 and writes to it; it dies before its checkpoint
        with pytest.raises(_Crash):
            c.drain_once(block_ms=10)
    assert shard_path(tmp_path / "D", 1).read_text().count("\n") == 5  # the crash point: rolled, not checkpointed
    assert redis_client.xlen(b.keys.results) >= 5, "rows not checkpointed must still be in Redis"

    restarted = Collector(redis_client, tmp_path, shard_rows=10)
    restarted.add("D")
    # Recovery removes the shard the crashed roll opened; appending to it again would write p10-p14 twice.
    assert not shard_path(tmp_path / "D", 1).exists()
    while restarted.drain_once(block_ms=10):
        pass
    assert _ids(tmp_path) == [f"p{i}" for i in range(15)]
    assert [json.loads(x)["id"] for x in shard_path(tmp_path / "D", 1).read_text().splitlines()] == [
        f"p{i}" for i in range(10, 15)]


def test_recovery_removes_shards_opened_after_the_checkpoint(tmp_path: Path) -> None:
    """Every shard beyond the checkpoint's goes, and the checkpointed ones stay as they were."""
    writer = JsonlShards(tmp_path / "D", shard_rows=2)
    writer.write([{"id": f"p{i}", "num_tokens": 1} for i in range(3)], "5-0")  # shards 0 (full) and 1
    kept = shard_path(tmp_path / "D", 0).read_bytes(), shard_path(tmp_path / "D", 1).read_bytes()
    for stale in (2, 3, 11):
        shard_path(tmp_path / "D", stale).write_bytes(b'{"id":"ghost","num_tokens":1}\n')
    reopened = open_writer(tmp_path / "D", shard_rows=2)
    assert sorted(p.name for p in (tmp_path / "D").glob("shard-*")) == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert (shard_path(tmp_path / "D", 0).read_bytes(), shard_path(tmp_path / "D", 1).read_bytes()) == kept
    assert [r["id"] for r in reopened.iter_kept()] == ["p0", "p1", "p2"]
    assert reopened.files() == ["shard-00000.jsonl", "shard-00001.jsonl"]


def test_a_refused_write_keeps_the_writer_at_its_last_durable_position(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = JsonlShards(tmp_path / "D", shard_rows=2)
    writer.write([{"id": "p0", "num_tokens": 1}], "1-0")
    with monkeypatch.context() as m:
        _refuse_checkpoints(m)
        with pytest.raises(OutputError):
            writer.write([{"id": f"p{i}", "num_tokens": 1} for i in range(1, 4)], "4-0")
    assert (writer.last_id, writer.rows) == ("1-0", 1)
    # The rows the failed batch got onto disk are not "kept": only the checkpointed one is.
    assert [r["id"] for r in JsonlShards(tmp_path / "D", shard_rows=2).iter_kept()] == ["p0"]
    # Writing the batch again (the folder has room now) writes it once, over what the failure left.
    writer.write([{"id": f"p{i}", "num_tokens": 1} for i in range(1, 4)], "4-0")
    assert [r["id"] for r in writer.iter_kept()] == ["p0", "p1", "p2", "p3"]
    assert [r["id"] for r in open_writer(tmp_path / "D", shard_rows=2).iter_kept()] == ["p0", "p1", "p2", "p3"]
    assert writer.files() == ["shard-00000.jsonl", "shard-00001.jsonl"]


def test_a_busy_stream_is_written_in_few_large_batches(tmp_path: Path, redis_client: redis.Redis) -> None:
    """Rows arriving all the time cost at most a checkpoint every WRITE_EVERY_S, not one per read,
    each row once; and someone waiting for the last rows (``pending``) gets them written at once."""
    import time

    from producer.collector import WRITE_EVERY_S

    b = Budget(redis_client, "D")
    b.open(10**9)
    c = Collector(redis_client, tmp_path, shard_rows=10_000)
    writer = c.add("D").writer
    batches: list[int] = []
    original = writer.write

    def counting(rows: list[dict[str, object]], last_id: str, ids: list[str] | None = None) -> None:
        batches.append(len(rows))
        original(rows, last_id, ids)

    writer.write = counting  # type: ignore[method-assign]
    c.start()
    t0 = time.monotonic()
    n = 0
    run_s = 2.0
    while time.monotonic() - t0 < run_s:  # a row every ~5 ms
        _keep(b, 1, start=n)
        n += 1
        time.sleep(0.005)
    deadline = time.monotonic() + 5
    while c.pending("D") and time.monotonic() < deadline:
        time.sleep(0.01)
    waited = time.monotonic()
    c.stop()
    assert c.error is None
    assert _ids(tmp_path) == [f"p{i}" for i in range(n)]
    assert sum(batches) == n
    # One write per period (plus the one pending() asked for, plus slack for timing), not one per read.
    assert n > 100 and len(batches) <= run_s / WRITE_EVERY_S + 3, batches
    assert waited - t0 < run_s + 1.0
