"""``regenerate = "all"`` on a real fleet, with a worker SIGKILLed mid-run: every turn is paid for
once (the simulator's billing ledger), except the requests the killed worker had in flight, and
every row is token-exact against the tokenizer's own template on its history."""

from __future__ import annotations

import json
import signal
import time

import pytest
import redis
import requests

from common.budget import Budget
from tests.conversation_data import billed_twice, check_rows, conversations
from tests.fleet import DEMO_TOKENIZER, Fleet, read_rows, read_summary, write_jsonl

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

N = 150


@pytest.mark.long
def test_conversations_survive_a_killed_worker_and_no_turn_is_paid_twice(fleet: Fleet,
                                                                         redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "150")
    data = write_jsonl(fleet.tmp / "conv.jsonl", conversations(N, seed=1))
    config = fleet.write_config([{"name": "CONV", "path": data, "length": "short", "regenerate": "all"}])
    victim = fleet.start_worker("victim", concurrency=40)
    fleet.start_worker("survivor", concurrency=40)
    producer = fleet.start_producer(config)
    fleet.wait_rows(redis_client, "CONV", 60, timeout_s=120)
    deadline = time.monotonic() + 60
    while fleet.log("victim").count("settle: kept") < 10:  # the victim is working, not just started
        assert time.monotonic() < deadline, fleet.all_logs()
        time.sleep(0.1)
    # Frozen first, so the leases read are exactly what it holds when it dies.
    victim.send_signal(signal.SIGSTOP)
    at_kill = {k.decode() for k in redis_client.hkeys("specfleet:ds:CONV:leases")}
    victim.send_signal(signal.SIGKILL)  # mid-run, with turns in flight
    victim.wait()
    victim_log = fleet.log("victim")
    victim_in_flight = victim_log.count("reserve: ok") - victim_log.count(" settle: ") - victim_log.count(" failed: ")
    assert victim_in_flight > 0 and at_kill
    t0 = time.monotonic()
    producer.wait(timeout=240)
    assert producer.returncode == 0, fleet.all_logs()

    summary = read_summary(fleet.out, "CONV")
    rows = read_rows(fleet.out, "CONV")
    check = check_rows(rows, DEMO_TOKENIZER)
    assert check.bad == [] and check.prompt_mismatch == 0
    # Every conversation has its outcome, and the budget counted exactly the rows on disk.
    assert summary["end_reason"] == "complete", summary
    assert summary["prompts"] == N and summary["conversations_ended"] + summary["failed"] == N
    assert summary["failures"] == {} and summary["skipped"] == 0
    assert check.conversations == N and summary["results"] == len(rows)
    assert summary["turns_per_conversation"] == {str(k): v for k, v in sorted(check.turns_per_conversation.items())}
    snap = Budget(redis_client, "CONV").snapshot()
    assert (snap.rows, snap.kept_tokens) == (len(rows), sum(r["num_tokens"] for r in rows))
    # Conversations went past their first turn, and some ended on tool calls.
    assert sum(v for k, v in check.turns_per_conversation.items() if k >= 3) > 10
    assert check.ends["tool_calls"] > 0 and check.ends["last_turn"] > 0

    # Paid once per turn: every billed request is a kept turn, and a turn billed again is one that
    # was in flight when the worker died.
    generations = requests.get(fleet.sim_url + "/_sim/stats?detail=1", timeout=30).json()["generations"]
    billing = billed_twice(generations, rows)
    print(f"{len(rows)} rows of {N} conversations, {billing.requests} billed requests, {billing.extra} billed "
          f"twice ({billing.abandoned} abandoned), {victim_in_flight} turns in flight in the killed worker, drain "
          f"{time.monotonic() - t0:.0f} s; ends {json.dumps(check.ends)}")
    assert billing.not_kept == 0
    assert billing.twice <= at_kill and billing.extra == len(billing.twice) <= victim_in_flight
    assert billing.requests == len(rows) + billing.extra


def test_a_larger_budget_continues_the_conversations_even_after_redis_lost_them(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    fleet.start_simulator("--latency-median-ms", "20")
    data = write_jsonl(fleet.tmp / "conv.jsonl", conversations(60, seed=2))
    dataset = {"name": "CONV", "path": data, "length": "short", "regenerate": "all"}
    small = fleet.write_config([{**dataset, "budget_tokens": 20_000}])
    fleet.start_worker("w1", concurrency=30)
    fleet.run_producer(small, name="producer1")
    first = read_summary(fleet.out, "CONV")
    rows_before = read_rows(fleet.out, "CONV")
    assert first["end_reason"] == "budget" and first["skipped"] > 0
    assert first["conversations_partial"] > 0  # stopped between turns of some conversations

    # A Redis without persistence restarted: the done set, the stored turns and the ends are gone;
    # the producer rebuilds them from the shards before anything is asked again.
    redis_client.flushdb()
    big = fleet.write_config([{**dataset, "budget_tokens": 10_000_000}])
    out = fleet.run_producer(big, name="producer2")
    assert "restoring from the shards" in out
    summary = read_summary(fleet.out, "CONV")
    rows = read_rows(fleet.out, "CONV")
    check = check_rows(rows, DEMO_TOKENIZER)
    assert check.bad == [] and check.prompt_mismatch == 0
    assert summary["end_reason"] == "complete" and summary["conversations_ended"] + summary["failed"] == 60
    assert summary["results"] == len(rows) and summary["results_this_run"] == len(rows) - len(rows_before)
    # The partial conversations went on from their kept turns: nothing kept was asked again.
    generations = requests.get(fleet.sim_url + "/_sim/stats?detail=1", timeout=30).json()["generations"]
    billing = billed_twice(generations, rows)
    assert (billing.not_kept, billing.extra) == (0, 0) and billing.requests == len(rows)
