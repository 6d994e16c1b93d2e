"""The Prometheus exporter against a real Redis, written the way workers and the producer write it."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from dataclasses import replace

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

from common import contract
from common.accounting import BY_NAME
from common.budget import Ask, Budget, open_run
from common.config import ThrottleLimits
from common.keys import CURRENT_RUN, DatasetKeys
from common.throttle import POLICY, FleetThrottle
from producer.metrics import SpecfleetCollector, make_registry, run_datasets, start_metrics_server

#: tests/conftest.py warm_pool: the tests share the simulators and workers they start alike
WARM_FLEET = True

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return _parse(resp.read().decode())


def _ds(name: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"dataset": name, **extra}.items()))


def _start_run(client: redis.Redis, datasets: list[str]) -> None:
    run = {"config_id": "cfg123", "datasets": datasets, "started_s": time.time(), "out_dir": "/out"}
    client.set(CURRENT_RUN, json.dumps(run))


def _keep(budget: Budget, prompt_id: str, tokens: int) -> None:
    assert budget.reserve(prompt_id, f"lease-{prompt_id}", ttl_ms=60_000, ask=Ask(100, 1_000_000, 100)).status == "ok"
    assert budget.settle(prompt_id, f"lease-{prompt_id}", tokens, b"row", cost_usd=0.0005) == "kept"


@pytest.fixture
def midrun(redis_client: redis.Redis) -> redis.Redis:
    """Dataset "short" mid-run (kept, failed, in flight, queued), "long" not started yet."""
    _start_run(redis_client, ["short", "long"])
    open_run(redis_client, 5.0, ["short", "long"])
    short = Budget(redis_client, "short")
    short.open(1_000, 2.0)
    _keep(short, "p1", 120)
    _keep(short, "p2", 80)
    assert short.reserve("p3", "lease-p3", ttl_ms=60_000, ask=Ask(100, 1_000_000, 100)).status == "ok"
    assert short.reserve("p4", "lease-p4", ttl_ms=60_000, ask=Ask(100, 1_000_000, 100)).status == "ok"
    assert short.fail("p4", "lease-p4", contract.FAIL_RETRIES_EXHAUSTED, 6, "HTTP 429 six times") == "failed"
    k = DatasetKeys("short")
    redis_client.rpush(k.queue, b"t5", b"t6", b"t7")
    redis_client.hset(
        k.stats,
        mapping={
            BY_NAME["requests"].source: 9,
            BY_NAME["billed_prompt_tokens"].source: 900,
            BY_NAME["billed_completion_tokens"].source: 260,
            BY_NAME["billed_reasoning_tokens"].source: 40,
            BY_NAME["cost_usd"].source: 1_250_000,
            "err:http_429": 6,
            "err:timeout": 1,
            f"fail:{contract.FAIL_RETRIES_EXHAUSTED}": 1,
        },
    )
    return redis_client


def test_scrape_reports_every_dataset_series(midrun: redis.Redis) -> None:
    reserved = Budget(midrun, "short").snapshot().reserved_tokens
    assert reserved > 0
    port = _free_port()
    start_metrics_server(midrun, port)
    m = _scrape(port)

    assert m[("specfleet_redis_up", ())] == 1
    assert m[("specfleet_run_info", (("config_id", "cfg123"),))] == 1
    short, long_ = _ds("short"), _ds("long")
    expected = {
        "specfleet_queue_length": 3,
        "specfleet_budget_tokens": 1_000,
        "specfleet_kept_tokens_total": 200,
        # The estimate is budget.lua's business: the exporter reports what the budget holds.
        "specfleet_reserved_tokens": reserved,
        "specfleet_budget_left_tokens": 800,
        "specfleet_rows_total": 2,
        "specfleet_failed": 1,
        "specfleet_in_flight": 1,
        "specfleet_requests_total": 9,
        "specfleet_billed_prompt_tokens_total": 900,
        "specfleet_billed_completion_tokens_total": 260,
        "specfleet_billed_reasoning_tokens_total": 40,
        "specfleet_cost_usd_total": 1.25,
        "specfleet_dataset_active": 1,
        # Dollars as the budget counts them (two kept answers), its limits and what p3 holds.
        "specfleet_spent_usd_total": 0.001,
        "specfleet_budget_usd": 2.0,
        "specfleet_held_usd": 0.001,
        "specfleet_run_budget_usd": 5.0,
        "specfleet_run_spent_usd": 0.001,
    }
    for name, value in expected.items():
        assert m[(name, short)] == pytest.approx(value), name
    assert m[("specfleet_upstream_errors_total", _ds("short", reason="http_429"))] == 6
    assert m[("specfleet_upstream_errors_total", _ds("short", reason="timeout"))] == 1
    assert m[("specfleet_failures_total", _ds("short", reason="retries_exhausted"))] == 1
    # The dataset not opened yet is present, at zero and inactive: dashboards list it from the start.
    assert m[("specfleet_budget_tokens", long_)] == 0
    assert m[("specfleet_dataset_active", long_)] == 0
    # One scrape is no rate yet.
    assert ("specfleet_kept_tokens_per_second", short) not in m


def test_scrape_reports_the_fleet_throttle(midrun: redis.Redis) -> None:
    """The throttle as the workers leave it: 6 in flight, 3 answered, 1 answered 429 (which cut the
    limit to 0.9 x the 6 in flight it did not refuse and paused the fleet), and the run's cap of 20
    (judged from the first request on: the judging itself is tests/test_throttle.py's)."""
    throttle = FleetThrottle(midrun, replace(POLICY, beta=0.9, min_requests=0, margin=0))
    throttle.reset(ThrottleLimits(max_in_flight=20))
    for i in range(10):
        assert throttle.acquire(f"s{i}", ttl_ms=60_000).ok
    for i in range(3):
        throttle.release(f"s{i}", "ok", ttl_ms=60_000)
    throttle.release("s3", "throttled", ttl_ms=60_000, retry_after_s=30)
    m = _parse(generate_latest(make_registry(midrun)).decode())
    assert m[("specfleet_throttle_limit", ())] == 5
    assert m[("specfleet_throttle_in_flight", ())] == 6
    assert 29 < m[("specfleet_throttle_paused_seconds", ())] <= 30
    assert m[("specfleet_upstream_throttled_total", ())] == 1
    assert m[("specfleet_upstream_ok_total", ())] == 3
    assert m[("specfleet_upstream_budget_refused_total", ())] == 0
    throttle.release("s4", "budget", ttl_ms=60_000, retry_after_s=1)  # a 402 in_flight_budget_exhausted
    m = _parse(generate_latest(make_registry(midrun)).decode())
    assert m[("specfleet_upstream_budget_refused_total", ())] == 1


def test_rate_comes_from_successive_scrapes(midrun: redis.Redis) -> None:
    port = _free_port()
    start_metrics_server(midrun, port)
    _scrape(port)
    time.sleep(0.5)
    _keep(Budget(midrun, "short"), "p9", 300)
    m = _scrape(port)
    rate = m[("specfleet_kept_tokens_per_second", _ds("short"))]
    # 300 tokens between two scrapes at least 0.5 s apart: at most 600 tokens/s.
    assert 50 < rate <= 600
    assert m[("specfleet_kept_tokens_per_second", _ds("long"))] == 0


def test_closed_dataset_is_inactive(midrun: redis.Redis) -> None:
    Budget(midrun, "short").close()
    m = _parse(generate_latest(make_registry(midrun)).decode())
    assert m[("specfleet_dataset_active", _ds("short"))] == 0


def test_no_run_exports_only_health(redis_client: redis.Redis) -> None:
    m = _parse(generate_latest(make_registry(redis_client)).decode())
    assert m == {("specfleet_redis_up", ()): 1}


def _dead_client() -> redis.Redis:
    # No retries: redis-py 8 retries with backoff by default, seconds of waiting for nothing here.
    return redis.Redis(host="127.0.0.1", port=_free_port(), retry=Retry(NoBackoff(), 0))


def test_redis_down_is_a_metric_not_a_scrape_error() -> None:
    dead = _dead_client()
    m = _parse(generate_latest(make_registry(dead)).decode())
    assert m == {("specfleet_redis_up", ()): 0}


def test_run_datasets_accepts_names_and_objects() -> None:
    assert run_datasets(None) == []
    assert run_datasets({"datasets": ["a", {"name": "b"}, {"x": 1}, ""]}) == ["a", "b"]


def test_describe_does_not_touch_redis() -> None:
    # describe() must not call Redis: registration happens before Redis may be up.
    collector = SpecfleetCollector(_dead_client())
    assert list(collector.describe()) == []


@pytest.mark.fleet
def test_skipped_equals_summary_once_a_budget_stop_purged_the_queue(fleet, redis_client: redis.Redis) -> None:  # type: ignore[no-untyped-def]
    """A budget stop purges the queued prompts; they have no outcome, and summary.json counts them as
    skipped. The exporter says the same, and how many prompts the dataset has."""
    from tests.fleet import read_summary

    fleet.start_simulator("--latency-median-ms", "200")
    fleet.start_worker("w1", concurrency=20)
    fleet.wait_ready("w1")
    config = fleet.one_dataset("S", 400, budget_tokens=15_000)
    fleet.run_producer(config)
    summary = read_summary(fleet.out, "S")
    assert summary["end_reason"] == "budget" and summary["skipped"] > 0, summary
    m = _parse(generate_latest(make_registry(redis_client)).decode())
    workers_skipped = int(redis_client.hget(DatasetKeys("S").stats, "skipped") or 0)
    # Most skipped prompts never reached a worker: they were purged from the queue at the stop.
    assert workers_skipped < summary["skipped"]
    assert m[("specfleet_skipped_total", _ds("S"))] == summary["skipped"]
    assert m[("specfleet_prompts", _ds("S"))] == summary["prompts"] == 400
    assert m[("specfleet_rows_total", _ds("S"))] + m[("specfleet_failed", _ds("S"))] + \
        m[("specfleet_skipped_total", _ds("S"))] == summary["prompts"]
