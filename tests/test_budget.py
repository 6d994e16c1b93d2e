"""budget.lua on a real server: admission, exactly-once counting, leases of dead workers."""

from __future__ import annotations

import time

import msgpack
import redis

from common.budget import MIN_ROWS_FOR_MEAN, Budget

TTL_MS = 60_000


def _row(pid: str) -> bytes:
    return msgpack.packb({"id": pid})


def test_unopened_dataset_admits_nothing(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "stopped"


def test_settle_counts_once_and_hands_the_row_over_once(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    assert b.snapshot().reserved == 10
    assert b.settle("p1", "L1", 42, _row("p1")) is True
    # A second delivery (acks_late after a crash) finishes the same prompt again.
    assert b.settle("p1", "L2", 42, _row("p1")) is False
    snap = b.snapshot()
    assert (snap.kept, snap.rows, snap.reserved, snap.in_flight) == (42, 1, 0, 0)
    assert redis_client.xlen(b.keys.results) == 1
    assert b.reserve("p1", "L3", ttl_ms=TTL_MS, prior_estimate=10).status == "done"


def test_live_lease_makes_a_second_delivery_wait(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    second = b.reserve("p1", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    assert second.status == "busy" and 0 < second.value <= TTL_MS
    # The same delivery asking again keeps its admission instead of reserving twice.
    assert b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    assert b.snapshot().reserved == 10


def test_expired_lease_is_taken_over_without_leaking_budget(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    assert b.reserve("p1", "dead", ttl_ms=1, prior_estimate=10).status == "ok"
    time.sleep(0.01)
    assert b.reserve("p1", "L2", ttl_ms=TTL_MS, prior_estimate=10).status == "ok"
    assert b.snapshot().reserved == 10
    # The dead worker's late settle still counts (paid work), and only once.
    assert b.settle("p1", "dead", 7, _row("p1")) is True
    assert b.settle("p1", "L2", 7, _row("p1")) is False
    snap = b.snapshot()
    assert (snap.kept, snap.reserved, snap.in_flight) == (7, 0, 0)


def test_reap_returns_estimates_of_expired_leases(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    b.reserve("p1", "L1", ttl_ms=1, prior_estimate=10)
    b.reserve("p2", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    time.sleep(0.01)
    assert b.reap() == 1
    snap = b.snapshot()
    assert (snap.reserved, snap.in_flight) == (10, 1)


def test_admission_stops_before_the_budget_and_marks_exhausted(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(100)
    statuses = [b.reserve(f"p{i}", f"L{i}", ttl_ms=TTL_MS, prior_estimate=30).status for i in range(5)]
    assert statuses == ["ok", "ok", "ok", "over", "stopped"]
    assert b.snapshot().state == "exhausted"
    # Admitted work still lands after the stop: paid tokens are not thrown away.
    assert b.settle("p0", "L0", 35, _row("p0")) is True
    assert b.snapshot().kept == 35


def test_estimate_becomes_the_running_mean(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(10_000_000)
    for i in range(MIN_ROWS_FOR_MEAN):
        b.reserve(f"p{i}", "L", ttl_ms=TTL_MS, prior_estimate=5)
        b.settle(f"p{i}", "L", 100, _row(f"p{i}"))
    r = b.reserve("next", "L", ttl_ms=TTL_MS, prior_estimate=5)
    assert (r.status, r.value) == ("ok", 100)


def test_failure_is_recorded_and_cleared_when_kept_later(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10)
    assert b.fail("p1", "L1", "retries_exhausted", 6, "http_429: slow down") is True
    assert b.failures()["p1"]["reason"] == "retries_exhausted"
    assert b.snapshot().reserved == 0
    b.reserve("p1", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    b.settle("p1", "L2", 5, _row("p1"))
    assert b.failures() == {}


def test_open_rederives_reserved_and_resumes_counts(redis_client: redis.Redis) -> None:
    b = Budget(redis_client, "ds")
    b.open(1_000)
    b.reserve("p1", "L1", ttl_ms=TTL_MS, prior_estimate=10)
    b.settle("p1", "L1", 50, _row("p1"))
    b.reserve("p2", "L2", ttl_ms=TTL_MS, prior_estimate=10)
    redis_client.hset(b.keys.budget, "reserved", 999)  # as if a crash left it wrong
    assert b.open(5_000) == (50, 1)
    snap = b.snapshot()
    assert (snap.limit, snap.reserved, snap.state) == (5_000, 10, "active")
