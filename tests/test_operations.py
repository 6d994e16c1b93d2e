"""Operating the fleet: graceful stops, workers joining mid-run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import Any

import pytest
import redis

from common import keys
from common.config import load_config
from tests.fleet import Fleet, prompts, read_summary, write_jsonl

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True


def test_sigterm_worker_finishes_in_flight_and_requeues_the_rest(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "1500")
    config = fleet.one_dataset("T", 120)
    first = fleet.start_worker("first", concurrency=40)
    producer = fleet.start_producer(config)
    fleet.wait_rows(redis_client, "T", 5)
    in_flight = int(redis_client.hlen("specfleet:ds:T:leases"))
    assert in_flight > 0
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0, fleet.log("first")
    # Warm shutdown: every request it had sent was finished and settled; none is left holding a lease.
    assert int(redis_client.hlen("specfleet:ds:T:leases")) == 0
    fleet.start_worker("second", concurrency=40)
    assert producer.wait(timeout=120) == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "T", 120)
    assert read_summary(fleet.out, "T")["failed"] == 0


def test_sigterm_producer_leaves_a_state_the_next_run_resumes(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "400")
    config = fleet.one_dataset("P", 150)
    fleet.start_worker("w1", concurrency=20)
    producer = fleet.start_producer(config, name="producer1")
    fleet.wait_rows(redis_client, "P", 20)
    producer.send_signal(signal.SIGTERM)
    assert producer.wait(timeout=30) == 130, fleet.log("producer1")
    assert "run the same command again to resume" in fleet.log("producer1")
    assert not redis_client.exists("specfleet:producer:lock")
    fleet.run_producer(config, name="producer2")
    fleet.assert_exactly_once(redis_client, "P", 150)
    assert read_summary(fleet.out, "P")["end_reason"] == "complete"


def test_a_worker_started_mid_run_finds_the_active_queue_and_takes_work(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    fleet.start_simulator("--latency-median-ms", "300")
    config = fleet.one_dataset("S", 300)
    # Two slow workers alone would need ~25 s for the run: time enough for a late worker to start
    # on a busy CI box (it took 8 s there once, against a run of 9 s with five slots each).
    fleet.start_worker("early1", concurrency=2)
    fleet.start_worker("early2", concurrency=2)
    producer = fleet.start_producer(config)
    fleet.wait_rows(redis_client, "S", 10)
    fleet.start_worker("late", concurrency=30)  # no broadcast reaches it: it must look by itself
    assert producer.wait(timeout=180) == 0, fleet.all_logs()
    late_log = fleet.log("late")
    assert "following specfleet.q.S" in late_log
    assert late_log.count("settle: kept") > 10, late_log[-3000:]
    fleet.assert_exactly_once(redis_client, "S", 300)


def test_workers_follow_a_new_dataset_when_the_producer_says_so_not_at_their_next_poll(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    """Two datasets in a row, workers polling the active queues only every 60 s: each dataset's
    first request follows its start within seconds, because the producer broadcasts the change."""
    fleet.start_simulator("--latency-median-ms", "100")
    config = fleet.write_config([
        {"name": name, "path": write_jsonl(fleet.tmp / f"{name}.jsonl", prompts(20, name.lower())),
         "length": "short", "budget_tokens": 10_000_000} for name in ("F1", "F2")])
    fleet.start_worker("w1", concurrency=10, SPECFLEET_QUEUE_POLL_S="60")
    fleet.wait_ready("w1")  # its one poll (at start) has found nothing active
    started = time.monotonic()
    fleet.run_producer(config, timeout_s=120)
    took_s = time.monotonic() - started
    for name in ("F1", "F2"):
        fleet.assert_exactly_once(redis_client, name, 20)
    # Polling alone, the first dataset would have waited up to 60 s, the second as long again.
    assert took_s < 30, f"{took_s:.1f} s\n{fleet.all_logs()}"
    assert fleet.log("w1").count("following specfleet.q.") == 2
    # Each queue reached the consumer's running BRPOP at once (CLIENT UNBLOCK through the kombu patch),
    # not when that BRPOP next returned.
    assert ", from the next poll" not in fleet.log("w1"), fleet.log("w1")


def test_a_worker_that_missed_the_broadcast_follows_a_new_queue_by_its_poll(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    """A queue made active with no broadcast (one lost on a blip, sent while the worker reconnected)
    is found by the worker's own poll of ``specfleet:active``, well after the worker started."""
    config = load_config(fleet.one_dataset("Q", 5))
    fleet.start_worker("w1", concurrency=5)
    fleet.wait_ready("w1")
    time.sleep(1.0)  # past its start-up reading of the active queues
    deadline = time.monotonic() + 30
    redis_client.set(keys.config(config.config_id()), config.worker_view().model_dump_json())
    redis_client.hset(keys.ACTIVE_QUEUES, keys.queue("Q"), config.config_id())
    while "following specfleet.q.Q" not in fleet.log("w1"):  # the tests' poll is 0.3 s
        assert time.monotonic() < deadline, fleet.log("w1")
        time.sleep(0.2)


def test_a_worker_refuses_a_tokenizer_that_fails_the_round_trip_before_any_request(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    from harness.tokenizer_factory import KIMI_K25, write_remote_tokenizer

    # Like transformers >= 5.4 on K2.5: a special id above the bug line decodes to something else.
    broken = write_remote_tokenizer(KIMI_K25, fleet.tmp / "buggy", class_name="BuggyDecodeTokenizer",
                                    first_bad_id_token="<think>")
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("BAD", 10, tokenizer=broken, trust_remote_code=True)
    worker = fleet.start_worker("strict", concurrency=5)
    producer = fleet.start_producer(config)
    worker.wait(timeout=60)
    log = fleet.log("strict")
    assert "refusing run" in log and "decodes to" in log, log[-3000:]
    assert fleet.sim_stats()["requests"] == 0  # not one paid request
    assert redis_client.llen("specfleet.q.BAD") == 10  # the work waits for a worker that can do it
    producer.send_signal(signal.SIGTERM)
    producer.wait(timeout=30)


def _halts_then_resumes(fleet: Fleet, redis_client: redis.Redis, status: int, fix: dict[str, Any]) -> None:
    """A refused account halts the fleet: the producer exits 3 naming the reason, the halt key says
    why, no prompt is marked failed, and no request is sent after the halt. Fixed, the same
    command resumes.

    The budget admits two requests at a time (prior 1,024 tokens, budget 3,000), so the rest of
    the worker's greenlets are parked in admission, re-asking the budget script every ~1 s: once
    the two come back refused, every one of them must end "halted" there, not send a request (the
    producer dropping the queue cannot stop tasks the worker already holds)."""
    config = fleet.one_dataset("H", 80, budget_tokens=3_000)
    fleet.start_worker("w1", concurrency=10)
    producer = fleet.start_producer(config, name="producer1")
    assert producer.wait(timeout=120) == 3, fleet.all_logs()
    assert f"OpenRouter refused the account (http_{status}" in fleet.log("producer1")
    halt = json.loads(redis_client.get("specfleet:halt") or b"{}")
    assert halt.get("reason") == f"http_{status}" and halt.get("worker"), halt
    deadline = time.monotonic() + 10  # the parked greenlets re-ask within ~1.5 s, then end
    while redis_client.hlen("specfleet:ds:H:leases") or "halted" not in fleet.log("w1"):
        assert time.monotonic() < deadline, fleet.all_logs()
        time.sleep(0.2)
    time.sleep(2)
    asked = fleet.sim_stats()["requests"]
    assert asked == 2, f"{asked} requests: only the two admitted before the first {status} may be sent"
    assert redis_client.hlen("specfleet:ds:H:failed") == 0
    assert redis_client.scard("specfleet:ds:H:done") == 0
    # The user fixes the key or the credits; the same command resumes (to its budget stop).
    fleet.sim_config(**fix)
    fleet.run_producer(config, name="producer2")
    assert not redis_client.exists("specfleet:halt")
    summary = read_summary(fleet.out, "H")
    assert (summary["end_reason"], summary["failed"]) == ("budget", 0), summary
    assert len(fleet.assert_exactly_once(redis_client, "H")) == summary["results"] > 0


def test_a_refused_account_halts_the_fleet_without_failing_prompts(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--expect-key", "sk-or-v1-the-right-key-000000")
    _halts_then_resumes(fleet, redis_client, 401, {"expect_key": None})


def test_out_of_credits_halts_the_fleet_without_failing_prompts(fleet: Fleet, redis_client: redis.Redis) -> None:
    """402 without Retry-After is "no credits": the account's fault, like 401, not the prompt's."""
    fleet.start_simulator("--latency-median-ms", "20")
    fleet.sim_config(rates={"402": 1.0})
    _halts_then_resumes(fleet, redis_client, 402, {"rates": {"402": 0}})


def test_a_second_producer_on_the_same_redis_is_refused(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "10")
    config = fleet.one_dataset("O", 30)
    first = fleet.start_producer(config, name="producer1")  # no worker: it waits with its queue full
    deadline = time.monotonic() + 30
    while redis_client.llen("specfleet.q.O") < 30:
        assert first.poll() is None and time.monotonic() < deadline, fleet.all_logs()
        time.sleep(0.1)
    owner = (redis_client.get("specfleet:producer:lock") or b"").decode()
    assert owner.endswith(f":{first.pid}"), owner
    second = fleet.start_producer(config, name="producer2")
    try:
        code = second.wait(timeout=30)
    except subprocess.TimeoutExpired:
        second.kill()
        pytest.fail("a second producer ran against a Redis another producer holds")
    assert code == 2, fleet.log("producer2")
    assert f"another producer ({owner}) is running against this Redis" in fleet.log("producer2")
    # The first run is untouched: still running, still the owner, its queue as it was.
    assert first.poll() is None
    assert (redis_client.get("specfleet:producer:lock") or b"").decode() == owner
    assert redis_client.llen("specfleet.q.O") == 30
    fleet.start_worker("w1", concurrency=10)
    assert first.wait(timeout=120) == 0, fleet.all_logs()
    fleet.assert_exactly_once(redis_client, "O", 30)
