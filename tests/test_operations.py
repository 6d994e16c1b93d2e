"""Operating the fleet: graceful stops, workers joining mid-run."""

from __future__ import annotations

import signal

import pytest
import redis

from tests.fleet import Fleet, read_summary

pytestmark = pytest.mark.fleet


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
    fleet.start_worker("early1", concurrency=5)
    fleet.start_worker("early2", concurrency=5)
    producer = fleet.start_producer(config)
    fleet.wait_rows(redis_client, "S", 10)
    fleet.start_worker("late", concurrency=30)  # no broadcast reaches it: it must look by itself
    assert producer.wait(timeout=180) == 0, fleet.all_logs()
    late_log = fleet.log("late")
    assert "following specfleet.q.S" in late_log
    assert late_log.count("settle: kept") > 10, late_log[-3000:]
    fleet.assert_exactly_once(redis_client, "S", 300)


def test_a_worker_refuses_a_tokenizer_that_fails_the_round_trip_before_any_request(
    fleet: Fleet, redis_client: redis.Redis
) -> None:
    from tests.tokenizer_factory import KIMI_K25, write_remote_tokenizer

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


def test_a_refused_account_halts_the_fleet_without_failing_prompts(fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20", "--expect-key", "sk-or-v1-the-right-key-000000")
    config = fleet.one_dataset("H", 80)
    fleet.start_worker("w1", concurrency=10)
    producer = fleet.start_producer(config, name="producer1")
    assert producer.wait(timeout=120) == 3, fleet.all_logs()
    assert "OpenRouter refused the account (http_401" in fleet.log("producer1")
    asked = fleet.sim_stats()["requests"]
    assert asked <= 15  # the in-flight handful, not 80 prompts each failing on its own
    assert redis_client.hlen("specfleet:ds:H:failed") == 0
    # The user fixes the key; the same command resumes and finishes everything.
    fleet.sim_config(expect_key=None)
    fleet.run_producer(config, name="producer2")
    fleet.assert_exactly_once(redis_client, "H", 80)
    assert read_summary(fleet.out, "H")["failed"] == 0
