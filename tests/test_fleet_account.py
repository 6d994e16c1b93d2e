"""The account's in-flight budget on a real fleet: 2 celery workers, Redis, the simulator with a
balance. OpenRouter estimates every running request at prompt + max_tokens and answers 402
``in_flight_budget_exhausted`` (with Retry-After) to what the balance cannot cover: the fleet must
slow down (its in-flight limit cut, every worker paused) and the prompts so refused must not spend
their attempts. What the provider saw is read in the simulator's counters."""

from __future__ import annotations

import pytest
import redis

from common.throttle import FleetThrottle
from tests.fleet import Fleet, read_rows, read_summary

pytestmark = pytest.mark.fleet
#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

#: max_tokens of the run's short class: large beside what the simulator's short answers use
#: (~650 tokens), so the estimates, not the spending, bind, as on a modest balance at 16k or 32k.
MAX_TOKENS = 8192
#: USD per token of the simulator's default price (0.60 / 2.50 per million).
PRICE_OUT = 2.5e-6


def _estimate_usd() -> float:
    return MAX_TOKENS * PRICE_OUT


def test_the_in_flight_budget_slows_the_fleet_and_spends_no_attempts(fleet: Fleet, redis_client: redis.Redis) -> None:
    """200 greenlets against a balance that covers ~48 worst cases in flight (fewer as it is spent),
    with no plan to start the limit there, and one attempt per prompt: every prompt is kept on its
    one attempt (before, each 402 was one of the prompt's attempts: prompts failed
    ``retries_exhausted`` while the fleet kept pushing)."""
    n, balance = 300, 1.0
    fleet.start_simulator("--latency-median-ms", "400", "--balance-usd", str(balance),
                          "--in-flight-retry-after-s", "1")
    # One attempt: a timeout would fail its prompt too, so give a loaded box room (the box the
    # tests share ran a 400 ms answer past 10 s at a load of 33).
    config = fleet.one_dataset("A", n, max_attempts=1, timeout_s=120)
    config.write_text(config.read_text().replace("max_tokens = 1024", f"max_tokens = {MAX_TOKENS}"))
    for i in range(2):
        fleet.start_worker(f"w{i + 1}", concurrency=100)
    # No plan: it would start the fleet's limit at what the balance covers; here the 402 alone must.
    producer = fleet.start_producer(config, "producer", "--no-plan")
    assert producer.wait(timeout=300) == 0, fleet.all_logs()
    summary = read_summary(fleet.out, "A")
    sim = fleet.sim_stats()
    refused = sim["account"]["refused"]
    fit_at_start = int(balance / _estimate_usd())
    print(f"summary {summary['results']} kept, {summary['failed']} failed, throttle {summary['throttle']}; "
          f"simulator {sim['requests']} requests, refused {refused}, billed ${sim['billed_cost_usd']:.4f}, "
          f"max held ${sim['account']['max_held_usd']:.4f}")
    assert summary["failed"] == 0, summary
    assert summary["results"] == n
    # A row counts the requests that ran: a 402 the account answered before running is not one.
    assert {row["attempts"] for row in read_rows(fleet.out, "A")} == {1}
    assert refused["weight_exceeds_budget"] == 0 and refused["insufficient_credits"] == 0
    assert refused["in_flight_budget_exhausted"] > 0  # the budget did bind
    # The fleet slowed: its limit was cut to what the balance covers, and the refusals after the
    # first wave (200 sent at once, ~150 of them over) were few. Ignored, each refused greenlet comes
    # back every Retry-After: more refusals than prompts.
    assert summary["throttle"]["budget_refused"] == refused["in_flight_budget_exhausted"]
    limit = FleetThrottle(redis_client).snapshot().limit
    assert limit is not None and limit <= fit_at_start, limit
    assert refused["in_flight_budget_exhausted"] < 200 + n * 0.1, refused
    assert sim["billed_cost_usd"] <= balance
    assert sim["account"]["max_held_usd"] <= balance


def test_a_request_whose_worst_case_exceeds_the_whole_balance_fails_at_once_naming_max_tokens(
        fleet: Fleet) -> None:
    n = 5
    fleet.start_simulator("--balance-usd", str(_estimate_usd() / 2))
    config = fleet.one_dataset("W", n, max_attempts=4)
    config.write_text(config.read_text().replace("max_tokens = 1024", f"max_tokens = {MAX_TOKENS}"))
    fleet.start_worker("w1", concurrency=10)
    fleet.run_producer(config, timeout_s=180)
    summary = read_summary(fleet.out, "W")
    failed = [line for line in (fleet.out / "W" / "failed.jsonl").read_text().splitlines() if line]
    assert summary["failed"] == n and len(failed) == n
    assert all('"weight_exceeds_budget"' in line and "max_tokens 8,192" in line for line in failed), failed
    sim = fleet.sim_stats()
    assert sim["account"]["refused"]["weight_exceeds_budget"] == n  # once each: never retried


def test_a_prompt_the_in_flight_budget_keeps_refusing_fails_after_in_flight_wait_max_s(
        fleet: Fleet, redis_client: redis.Redis) -> None:
    """A balance that covers ~2.5 worst cases in flight, 2 s answers and 10 prompts at once, no plan:
    two at a time run, the others are refused again and again. With ``[retry] in_flight_wait_max_s
    = 3`` the ones still refused 3 s after their first 402 fail ``in_flight_budget_exhausted``,
    naming the setting (without the cap all ten wait their turn and are kept)."""
    n = 10
    fleet.start_simulator("--latency-median-ms", "2000", "--balance-usd", str(_estimate_usd() * 2.5),
                          "--in-flight-retry-after-s", "1")
    config = fleet.one_dataset("Q", n, max_attempts=2, timeout_s=60)
    text = config.read_text().replace("max_tokens = 1024", f"max_tokens = {MAX_TOKENS}")
    config.write_text(text.replace("max_attempts = 2", "max_attempts = 2\nin_flight_wait_max_s = 3", 1))
    fleet.start_worker("w1", concurrency=40)
    producer = fleet.start_producer(config, "producer", "--no-plan")
    assert producer.wait(timeout=300) == 0, fleet.all_logs()
    summary = read_summary(fleet.out, "Q")
    failed = [line for line in (fleet.out / "Q" / "failed.jsonl").read_text().splitlines() if line]
    print(f"capped wait: {summary['results']} kept, {summary['failed']} failed in_flight_budget_exhausted")
    assert summary["results"] + summary["failed"] == n, summary
    assert summary["failed"] >= 3 and len(failed) == summary["failed"], summary
    assert all('"in_flight_budget_exhausted"' in line and "in_flight_wait_max_s = 3" in line for line in failed), \
        failed[:3]
