"""End to end on a real fleet: producer, Redis queues, gevent workers, the simulator over HTTP."""

from __future__ import annotations

import base64
import json
import signal
import time

import pytest
import redis

from common.budget import POLICY
from tests.fleet import TEST_KEY, Fleet, prompts, read_rows, read_summary, write_jsonl

pytestmark = pytest.mark.fleet


def test_budget_stop_then_next_dataset_runs_to_its_end(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "50")
    a = write_jsonl(fleet.tmp / "a.jsonl", prompts(600, "a"))
    b = write_jsonl(fleet.tmp / "b.jsonl", prompts(40, "b"))
    budget = 20_000
    config = fleet.write_config([
        {"name": "A_small", "path": a, "length": "short", "budget_tokens": budget},
        {"name": "B_rest", "path": b, "length": "short", "budget_tokens": 10_000_000},
    ])
    fleet.start_worker("w1", concurrency=40)
    fleet.start_worker("w2", concurrency=40)
    out = fleet.run_producer(config)

    sa, sb = read_summary(fleet.out, "A_small"), read_summary(fleet.out, "B_rest")
    assert sa["end_reason"] == "budget"
    rows_a = fleet.assert_exactly_once(redis_client, "A_small")
    mean = sa["tokens"] / len(rows_a)
    # The hard cap (the default): never over, and short by less than one worst-case answer
    # (max_tokens 1024 plus the turn's own tokens).
    print(f"A_small kept {sa['tokens']} of {budget} ({sa['tokens'] / budget:.1%}), mean row {mean:.0f}")
    assert budget - POLICY.worst_tokens(1024) < sa["tokens"] <= budget, sa
    assert sa["results"] + sa["skipped"] + sa["failed"] == 600
    assert sa["skipped"] > 0
    assert sb["end_reason"] == "complete" and sb["results"] == 40
    fleet.assert_exactly_once(redis_client, "B_rest")
    assert "A_small: budget reached" in out and "B_rest: all prompts done" in out
    # Paid tokens are not thrown away: everything billed was kept (no cancelled in-flight work).
    billed = fleet.sim_stats()
    assert billed["billed_completion_tokens"] <= 1.02 * (sa["tokens"] + sb["tokens"]) + 2000
    # Nothing of A is left queued, and workers no longer follow it.
    assert redis_client.llen("specfleet.q.A_small") == 0
    assert not redis_client.hexists("specfleet:active", "specfleet.q.A_small")


def test_rows_load_with_datasets_and_carry_both_trainer_forms(fleet: Fleet) -> None:
    datasets = pytest.importorskip("datasets", reason="the `datasets` package is in the dev extra")
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("D", 30)
    fleet.start_worker("w1", concurrency=20)
    fleet.run_producer(config)
    files = sorted(str(p) for p in (fleet.out / "D").glob("shard-*.jsonl"))
    ds = datasets.load_dataset("json", data_files=files, split="train")
    assert len(ds) == 30
    row = ds[0]
    assert row["conversations"][-1]["role"] == "assistant"
    assert set(row["usage"]) >= {"prompt_tokens", "completion_tokens", "reasoning_tokens", "cost"}
    assert row["provider"] and row["finish_reason"] in ("stop", "length", "tool_calls")
    summary = read_summary(fleet.out, "D")
    for key in ("dataset", "results", "failed", "skipped", "tokens", "budget_tokens", "billed_prompt_tokens",
                "billed_completion_tokens", "cost_usd", "wall_s"):
        assert key in summary


def test_sigkilled_worker_loses_and_duplicates_nothing(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "1500")
    config = fleet.one_dataset("K", 150, timeout_s=5)
    victim = fleet.start_worker("victim", concurrency=60)
    fleet.start_worker("survivor", concurrency=60)
    producer = fleet.start_producer(config)
    fleet.wait_rows(redis_client, "K", 20)
    assert int(redis_client.hlen("specfleet:ds:K:leases")) > 0
    victim.send_signal(signal.SIGKILL)  # mid-run, with requests in flight
    producer.wait(timeout=180)
    assert producer.returncode == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "K", 150)
    assert read_summary(fleet.out, "K")["failed"] == 0


def test_producer_killed_then_resumed(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "300")
    config = fleet.one_dataset("R", 200)
    fleet.start_worker("w1", concurrency=30)
    first = fleet.start_producer(config, name="producer1")
    fleet.wait_rows(redis_client, "R", 30)
    first.send_signal(signal.SIGKILL)
    first.wait()
    fleet.run_producer(config, name="producer2")
    fleet.assert_exactly_once(redis_client, "R", 200)
    assert read_summary(fleet.out, "R")["end_reason"] == "complete"


def test_larger_budget_collects_more_from_the_same_data(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20")
    data = write_jsonl(fleet.tmp / "g.jsonl", prompts(300, "g"))
    small = fleet.write_config([{"name": "G", "path": data, "length": "short", "budget_tokens": 8_000}])
    fleet.start_worker("w1", concurrency=20)
    fleet.run_producer(small, name="producer1")
    first = read_summary(fleet.out, "G")
    assert first["end_reason"] == "budget"
    asked_before = fleet.sim_stats()["requests"]
    big = fleet.write_config([{"name": "G", "path": data, "length": "short", "budget_tokens": 20_000}])
    fleet.run_producer(big, name="producer2")
    second = read_summary(fleet.out, "G")
    rows = fleet.assert_exactly_once(redis_client, "G")
    assert second["results"] > first["results"] and len(rows) == second["results"]
    # Kept rows were not asked for again.
    assert fleet.sim_stats()["requests"] - asked_before < 300 - first["results"] + 50


def test_malformed_rows_are_reported_and_the_rest_runs(fleet: Fleet) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    rows: list = prompts(20, "m")
    rows[3] = '{"id": "broken", "messages": ['
    rows[7] = {"id": "nouser", "messages": [{"role": "system", "content": "x"}]}
    rows[9] = {"id": "badrole", "messages": [{"role": "robot", "content": "x"}]}
    rows.append({"conversations": [{"from": "human", "value": "sharegpt row without id"}]})
    data = write_jsonl(fleet.tmp / "m.jsonl", rows)
    config = fleet.write_config([{"name": "M", "path": data, "length": "short", "budget_tokens": 10_000_000}])
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config)
    summary = read_summary(fleet.out, "M")
    assert summary["malformed"] == 3 and summary["results"] == 18
    bad = [json.loads(x) for x in (fleet.out / "M" / "malformed.jsonl").read_text().splitlines()]
    assert [b["where"] for b in bad] == [f"{data}:4", f"{data}:8", f"{data}:10"]
    assert "not valid JSON" in bad[0]["reason"] and "messages[0].role" in bad[2]["reason"]
    assert any(r["id"].startswith("h-") for r in read_rows(fleet.out, "M"))


def test_faults_end_every_prompt_as_kept_or_failed_with_reason(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--hang-s", "30")
    fleet.sim_config(rates={"429": 0.15, "502": 0.05, "503": 0.05, "hang": 0.03, "bad_json": 0.05,
                            "error200": 0.05, "leak_im_end": 0.2})
    config = fleet.one_dataset("F", 200, timeout_s=2, max_attempts=3)
    fleet.start_worker("w1", concurrency=50)
    fleet.run_producer(config)
    summary = read_summary(fleet.out, "F")
    rows = fleet.assert_exactly_once(redis_client, "F")
    failed = [json.loads(x) for x in (fleet.out / "F" / "failed.jsonl").read_text().splitlines()]
    assert len(rows) + len(failed) == 200 and summary["skipped"] == 0
    assert all(f["reason"] in ("retries_exhausted", "upstream_fatal") and f["detail"] for f in failed)
    assert summary["errors"], "faults were injected, so errors by class must be counted"
    assert not any(r["conversations"][-1].get("content", "") and
                   r["conversations"][-1]["content"].endswith("<|im_end|>") for r in rows)


def test_api_key_never_reaches_redis_messages_logs_or_output(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("S", 20)
    producer = fleet.start_producer(config)
    deadline = time.monotonic() + 30
    while redis_client.llen("specfleet.q.S") < 20:  # no worker yet: the task messages wait in the queue
        assert time.monotonic() < deadline, fleet.all_logs()
        time.sleep(0.1)
    secret = TEST_KEY.encode()
    for message in redis_client.lrange("specfleet.q.S", 0, -1):
        body = base64.b64decode(json.loads(message)["body"])
        assert secret not in message and secret not in body
        assert b"Question" in body  # the prompt is in there, so the check looks at the right bytes
    fleet.start_worker("w1", concurrency=10, SPECFLEET_LOG_LEVEL="DEBUG")
    producer.wait(timeout=120)
    assert producer.returncode == 0, fleet.all_logs()
    out = fleet.log("producer")
    for key in redis_client.scan_iter("*"):
        dumped = redis_client.dump(key) or b""
        assert secret not in dumped, f"API key found in Redis key {key!r}"
    for path in fleet.tmp.rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), f"API key found in {path}"
    assert TEST_KEY not in out


def test_redis_losing_its_data_duplicates_nothing_on_disk(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("L", 40)
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config, name="producer1")
    asked = fleet.sim_stats()["requests"]
    redis_client.flushdb()  # a Redis without persistence restarted
    fleet.run_producer(config, name="producer2")
    assert "restoring from the shards" in fleet.log("producer2")
    assert fleet.sim_stats()["requests"] == asked  # nothing asked again
    fleet.assert_exactly_once(redis_client, "L", 40)
