"""The queue window (producer/window.py) on a real fleet: Redis holds a window of a dataset, not the
dataset, and the budget stop, the switch to the next dataset and a resume still keep every prompt once.

Each test watches the queue's length from outside while the run goes: the old producer queued the
whole file (the length reached the file's size), so each fails on it.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from common import keys
from harness.zygote import Zygotes
from tests.chaos import RestartableValkey
from tests.fleet import Fleet, prompts, read_summary, write_jsonl

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


@contextmanager
def longest_queue(client: redis.Redis, *datasets: str) -> Iterator[dict[str, int]]:
    """The longest each dataset's queue was while the block ran, sampled every 20 ms."""
    seen = {d: 0 for d in datasets}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            for d in datasets:
                seen[d] = max(seen[d], int(client.llen(keys.queue(d))))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield seen
    finally:
        stop.set()
        t.join()


def big_prompts(path: Path, n: int, size_bytes: int) -> Path:
    """``n`` distinct prompts of about ``size_bytes`` each (words, so they tokenize as text does)."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards"]
    line = " ".join(words * (size_bytes // 60 + 1))
    with path.open("w") as fh:
        for i in range(n):
            text = f"Prompt {i}: {line[i % 60:i % 60 + size_bytes]}"
            fh.write(json.dumps({"id": f"m{i:05d}", "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


#: small_redis's memory: small, since each row of a file twice its size costs CPU (the prompts' tokens)
SMALL_REDIS_BYTES = 10 << 20


@pytest.fixture
def small_redis(tmp_path: Path) -> Iterator[RestartableValkey]:
    """A Valkey as compose.yaml configures it (noeviction, AOF on), but with ``SMALL_REDIS_BYTES``."""
    valkey = RestartableValkey(tmp_path / "valkey")
    valkey.start()
    client = redis.Redis.from_url(valkey.url)
    client.config_set("maxmemory", str(SMALL_REDIS_BYTES))
    client.close()
    try:
        yield valkey
    finally:
        valkey.stop()


@pytest.mark.timeout(1500)
@pytest.mark.long
def test_a_dataset_twice_the_size_of_redis_runs_to_its_end_with_every_prompt_once(
        tmp_path: Path, small_redis: RestartableValkey, zygotes: Zygotes | None) -> None:
    n = 2700  # of 8 KB: the file is twice the size of Redis
    data = big_prompts(tmp_path / "big.jsonl", n, 8_000)
    assert data.stat().st_size > 2 * SMALL_REDIS_BYTES
    fleet = Fleet(tmp_path, small_redis.url, zygotes=zygotes)
    client = redis.Redis.from_url(small_redis.url)
    try:
        fleet.start_simulator("--latency-median-ms", "50")
        config = fleet.write_config([{"name": "Big", "path": data, "length": "short", "budget_tokens": 10**9}],
                                    timeout_s=60)
        # 12 each: what the workers hold (unacked), their rows waiting for the producer (~80 of
        # ~20 KB between two collector writes) and the clients' buffers take ~6 MiB of this Redis,
        # whatever the file's size. At 20 each the peak reached 8.6-9.1 MiB of 10 (the test failed
        # on its 9 MiB line), at 12 each 7.7-7.8; the run is CPU-bound either way, so no slower.
        fleet.start_worker("w1", concurrency=12)
        fleet.start_worker("w2", concurrency=12)
        with longest_queue(client, "Big") as longest:
            fleet.run_producer(config, timeout_s=1400, env={"SPECFLEET_QUEUE_WINDOW_BYTES": str(1 << 20)})
        memory = client.info("memory")
        print(f"longest queue {longest['Big']:,} of {n:,}; Redis peak {memory['used_memory_peak'] / 2**20:.1f} MiB")
        fleet.assert_exactly_once(client, "Big", n)
        summary = read_summary(fleet.out, "Big")
        assert (summary["end_reason"], summary["prompts"], summary["failed"]) == ("complete", n, 0), summary
        logs = fleet.all_logs()
        assert "OOM" not in logs and "OutOfMemory" not in logs and "refuses writes" not in logs, logs[-8000:]
        # 1 MiB of ~10 KB messages: ~100 queued at once (the old producer queued the whole file),
        # and Redis never near the limit where it refuses writes (7.7-7.8 MiB measured).
        assert longest["Big"] <= 120, longest
        assert memory["used_memory_peak"] < SMALL_REDIS_BYTES * 9 // 10, memory["used_memory_peak_human"]
    finally:
        fleet.stop_all()
        client.close()


@pytest.mark.timeout(900)
def test_the_budget_stop_and_the_switch_with_the_window(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "50")
    a = write_jsonl(fleet.tmp / "a.jsonl", prompts(20_000, "a"))
    b = write_jsonl(fleet.tmp / "b.jsonl", prompts(300, "b"))
    config = fleet.write_config([
        {"name": "A", "path": a, "length": "short", "budget_tokens": 20_000},
        {"name": "B", "path": b, "length": "short", "budget_tokens": 10_000_000},
    ])
    fleet.start_worker("w1", concurrency=40)
    fleet.start_worker("w2", concurrency=40)
    with longest_queue(redis_client, "A", "B") as longest:
        fleet.run_producer(config, timeout_s=800, env={"SPECFLEET_QUEUE_WINDOW_PROMPTS": "500"})
    sa, sb = read_summary(fleet.out, "A"), read_summary(fleet.out, "B")
    print(f"longest queues {longest}; switch {sa['switch_s']} s")
    assert sa["end_reason"] == "budget" and 0 < sa["results"] < 1000, sa
    # The whole file is counted, though most of it was never queued.
    assert sa["prompts"] == 20_000 and sa["results"] + sa["skipped"] + sa["failed"] == 20_000, sa
    assert sa["switch_s"] is not None
    assert sb["end_reason"] == "complete" and sb["results"] == 300, sb
    fleet.assert_exactly_once(redis_client, "A")
    fleet.assert_exactly_once(redis_client, "B", 300)
    assert longest["A"] <= 500 and longest["B"] <= 500, longest
    assert redis_client.llen(keys.queue("A")) == 0


@pytest.mark.timeout(900)
@pytest.mark.long
def test_a_resume_mid_dataset_with_the_window_keeps_every_prompt_once(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "300")
    config = fleet.one_dataset("R", 700)  # a whole-file queue would be 700, over 3 windows
    window = {"SPECFLEET_QUEUE_WINDOW_PROMPTS": "200"}
    fleet.start_worker("w1", concurrency=30)
    with longest_queue(redis_client, "R") as longest:
        first = fleet.start_producer(config, "producer1", env=window)
        fleet.wait_rows(redis_client, "R", 250, timeout_s=400)  # 450 left: over two windows
        first.send_signal(signal.SIGKILL)
        first.wait()
        fleet.run_producer(config, name="producer2", timeout_s=400, env=window)
    print(f"longest queue {longest}")
    fleet.assert_exactly_once(redis_client, "R", 700)
    summary = read_summary(fleet.out, "R")
    assert (summary["end_reason"], summary["prompts"], summary["failed"]) == ("complete", 700, 0), summary
    assert "resuming with" in fleet.log("producer2")
    # A worker's unacked restore (its timer) may put back what it held past the window: by its 30 at most.
    assert longest["R"] <= 200 + 30, longest
