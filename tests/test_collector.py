"""Rows reach disk exactly once: a crash between writing and checkpointing writes nothing twice."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import redis

from common.budget import Budget
from producer.collector import CHECKPOINT, Collector, shard_path


def _keep(b: Budget, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        pid = f"p{i}"
        b.reserve(pid, "L", ttl_ms=60_000, prior_estimate=1)
        b.settle(pid, "L", 3, msgpack.packb({"id": pid, "num_tokens": 3, "text": "héllo ✓"}))


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
    b.reserve("p", "L", ttl_ms=60_000, prior_estimate=1)
    b.settle("p", "L", 3, msgpack.packb({"id": "p", "content": tricky}))
    c = Collector(redis_client, tmp_path, shard_rows=10)
    c.add("D")
    c.drain_once(block_ms=10)
    text = shard_path(tmp_path / "D", 0).read_text(encoding="utf-8")
    assert len(text.splitlines()) == 1  # splitlines() breaks at U+2028/2029/0085 when they are raw
    assert json.loads(text)["content"] == tricky


def test_a_crash_during_a_shard_roll_writes_nothing_twice(tmp_path: Path, redis_client: redis.Redis) -> None:
    """The collector filled shard 0, opened shard 1 and wrote rows to it, then died before the
    checkpoint said so: on restart those rows are written again, and must appear once."""
    b = Budget(redis_client, "D")
    b.open(10_000)
    _keep(b, 10)
    c = Collector(redis_client, tmp_path, shard_rows=10)
    c.add("D")
    while c.drain_once(block_ms=10):
        pass
    checkpoint = json.loads((tmp_path / "D" / CHECKPOINT).read_text())
    assert (checkpoint["shard"], checkpoint["rows_in_shard"]) == (0, 10)  # shard 0 is full
    _keep(b, 5, start=10)
    # The roll reached the disk, its checkpoint did not.
    stale = b"".join(json.dumps({"id": f"p{i}", "num_tokens": 3}).encode() + b"\n" for i in range(10, 13))
    shard_path(tmp_path / "D", 1).write_bytes(stale)
    restarted = Collector(redis_client, tmp_path, shard_rows=10)
    restarted.add("D")
    while restarted.drain_once(block_ms=10):
        pass
    assert _ids(tmp_path) == [f"p{i}" for i in range(15)]
    assert [p.name for p in sorted((tmp_path / "D").glob("shard-*"))] == ["shard-00000.jsonl", "shard-00001.jsonl"]
